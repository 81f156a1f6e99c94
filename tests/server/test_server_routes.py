"""The small routes: models, health, version, metrics, tokenize, detokenize, reset_prefix_cache."""

from __future__ import annotations

import asyncio

import httpx
import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import MODEL, assert_error, completion_body

from metrics.prometheus import PrometheusStatLogger
from metrics.stats import IterationStats, SchedulerStats
from server.app import create_app


def test_models(client: TestClient, engine: FakeEngine) -> None:
    body = client.get("/v1/models").json()
    assert body["object"] == "list"
    [card] = body["data"]
    assert card["id"] == MODEL and card["object"] == "model" and card["owned_by"] == "brine"
    assert isinstance(card["created"], int) and card["max_model_len"] == engine.max_model_len
    assert client.get(f"/v1/models/{MODEL}").json() == card


def test_health_and_version(client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    assert isinstance(client.get("/version").json()["version"], str)


def test_metrics_renders_the_stat_logger(engine: FakeEngine) -> None:
    prom = PrometheusStatLogger(MODEL)
    prom.record(SchedulerStats(kv_cache_usage=0.25), IterationStats())
    r = TestClient(create_app(engine, metrics=prom)).get("/metrics")
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
    samples = {s.name: s.value for f in text_string_to_metric_families(r.text) for s in f.samples}
    assert samples["brine_kv_cache_usage_perc"] == 0.25


def test_metrics_without_logger(client: TestClient) -> None:
    r = client.get("/metrics")
    assert r.status_code == 200 and r.text == ""


def test_tokenize_and_detokenize(client: TestClient, engine: FakeEngine) -> None:
    r = client.post("/tokenize", json={"prompt": "héllo"}).json()
    assert r["tokens"] == engine.tokenizer.encode("héllo") and r["count"] == 6
    assert r["max_model_len"] == engine.max_model_len
    assert client.post("/detokenize", json={"tokens": r["tokens"]}).json() == {"prompt": "héllo"}
    chat = client.post("/tokenize", json={"messages": [{"role": "user", "content": "x"}]}).json()
    assert engine.tokenizer.decode(chat["tokens"], skip_special_tokens=False).endswith("assistant\n")


def test_tokenize_errors(client: TestClient) -> None:
    assert_error(client.post("/tokenize", json={}), 400, "prompt")
    both = {"prompt": "x", "messages": [{"role": "user", "content": "x"}]}
    assert_error(client.post("/tokenize", json=both), 400, "prompt")
    assert_error(client.post("/tokenize", json={"prompt": "x", "model": "nope"}), 404, "model")
    assert_error(client.post("/detokenize", json={"tokens": [-1]}), 400, "tokens")
    assert_error(client.post("/detokenize", json={"tokens": ["a"]}), 400, "tokens")


KEY = "operator-key"
AUTH = {"Authorization": f"Bearer {KEY}"}


def test_reset_prefix_cache_asks_the_engine_and_reports_its_answer(
    engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    # That a reset empties the cache is the engine's claim (tests/engine/test_async_engine.py); the route's
    # part is to ask it once per call and to report what it said. An operator's (keyed) reset is not forced.
    answers = [True, False]
    asked: list[bool] = []

    def reset(force: bool = False) -> bool:
        asked.append(force)
        return answers[len(asked) - 1]

    monkeypatch.setattr(engine, "reset_prefix_cache", reset)
    client = TestClient(create_app(engine, api_keys=[KEY]))
    assert client.post("/reset_prefix_cache", headers=AUTH).json() == {"reset": True}
    assert_error(client.post("/reset_prefix_cache", headers=AUTH), 409, code="prefix_cache_in_use")
    assert asked == [False, False]


def test_a_keyless_servers_reset_is_forced(
    client: TestClient, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    asked: list[bool] = []

    def reset(force: bool = False) -> bool:
        asked.append(force)
        return True

    monkeypatch.setattr(engine, "reset_prefix_cache", reset)
    assert client.post("/reset_prefix_cache").json() == {"reset": True}
    assert asked == [True]


async def test_reset_prefix_cache_conflicts_with_running_requests_for_the_operator() -> None:
    engine = FakeEngine(step_delay=0.01)
    transport = httpx.ASGITransport(app=create_app(engine, api_keys=[KEY]))
    async with httpx.AsyncClient(transport=transport, base_url="http://test", headers=AUTH) as client:
        running = asyncio.create_task(client.post("/v1/completions", json=completion_body(max_tokens=40)))
        while not engine.running:
            await asyncio.sleep(0.005)
        r = await client.post("/reset_prefix_cache")
        assert_error(r, 409, code="prefix_cache_in_use")
        assert (await running).status_code == 200
        assert (await client.post("/reset_prefix_cache")).status_code == 200


async def test_a_keyless_reset_answers_the_same_whether_or_not_others_run() -> None:
    # Anyone may reset a server without keys: a 409 would tell any caller that someone else is running.
    engine = FakeEngine(step_delay=0.01)
    transport = httpx.ASGITransport(app=create_app(engine))
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        idle = await client.post("/reset_prefix_cache")
        running = asyncio.create_task(client.post("/v1/completions", json=completion_body(max_tokens=40)))
        while not engine.running:
            await asyncio.sleep(0.005)
        busy = await client.post("/reset_prefix_cache")
        assert (idle.status_code, idle.json()) == (busy.status_code, busy.json()) == (200, {"reset": True})
        assert (await running).status_code == 200  # the running request is untouched
