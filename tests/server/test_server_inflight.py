"""The per-namespace cap on generation requests in flight (issue 28, section 5): over it, a 429 in OpenAI's
shape with `Retry-After`; other namespaces are untouched, and every slot comes back however a request ends."""

from __future__ import annotations

import asyncio
import gc

import httpx
import pytest
from fake_engine import FakeEngine
from server_helpers import MODEL, assert_error, completion_body

from kv_cache.namespace import CacheNamespace
from server.app import create_app
from server.inflight import InflightLimiter
from server.limits import RequestLimits


def limited_app(engine: FakeEngine, cap: int = 2):
    return create_app(engine, limits=RequestLimits(max_requests_per_namespace=cap))


async def _wait_running(engine: FakeEngine, n: int) -> None:
    while len(engine.running) < n:
        await asyncio.sleep(0.005)


def _assert_429(r: httpx.Response) -> None:
    assert r.status_code == 429, r.text
    assert r.headers["retry-after"] == "1"
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["code"] == "rate_limit_exceeded"
    assert "salt-a" not in err["message"]  # never names the namespace


async def test_a_namespace_over_its_cap_gets_a_429_and_others_do_not() -> None:
    engine = FakeEngine(model_name=MODEL, step_delay=0.01)
    app = limited_app(engine)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        body = completion_body(max_tokens=30, cache_salt="salt-a")
        held = [asyncio.create_task(client.post("/v1/completions", json=body)) for _ in range(2)]
        await _wait_running(engine, 2)
        _assert_429(await client.post("/v1/completions", json=body))
        _assert_429(
            await client.post(
                "/v1/chat/completions", json={**body, "messages": [{"role": "user", "content": "x"}]}
            )
        )
        other = await client.post("/v1/completions", json=completion_body(max_tokens=2, cache_salt="salt-b"))
        assert other.status_code == 200
        assert [r.status_code for r in await asyncio.gather(*held)] == [200, 200]
        # Their slots came back: salt-a may run again.
        assert (await client.post("/v1/completions", json={**body, "max_tokens": 2})).status_code == 200
    assert app.state.inflight.in_flight(CacheNamespace(salt="salt-a")) == 0


async def test_streams_hold_their_slot_until_they_end_and_failures_give_it_back() -> None:
    engine = FakeEngine(model_name=MODEL, step_delay=0.01)
    app = limited_app(engine, cap=1)
    transport = httpx.ASGITransport(app=app)
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as client:
        body = completion_body(max_tokens=30, stream=True)  # unsalted requests share one bucket
        streaming = asyncio.create_task(client.post("/v1/completions", json=body))
        await _wait_running(engine, 1)
        _assert_429(await client.post("/v1/completions", json=completion_body(max_tokens=2)))
        done = await streaming
        assert done.status_code == 200 and done.text.endswith("data: [DONE]\n\n")
        assert app.state.inflight.in_flight(None) == 0
        # A request the engine refuses before its first output (context length) releases its slot.
        too_long = completion_body(max_tokens=10_000)
        assert_error(await client.post("/v1/completions", json=too_long), 400)
        assert (await client.post("/v1/completions", json=completion_body(max_tokens=2))).status_code == 200
    assert app.state.inflight.in_flight(None) == 0


def test_a_slot_is_released_once_and_by_the_garbage_collector_as_a_last_resort() -> None:
    limiter = InflightLimiter(1)
    ns = CacheNamespace(tenant="t", salt="s")

    class Owner:
        pass

    owner = Owner()
    release = limiter.acquire(ns, owner)
    with pytest.raises(Exception) as err:
        limiter.acquire(CacheNamespace(tenant="t", salt="other"), Owner())  # the tenant's bucket, any salt
    assert getattr(err.value, "status", None) == 429
    release()
    release()  # a second call does nothing
    assert limiter.in_flight(ns) == 0
    limiter.acquire(ns, owner := Owner())
    del owner
    gc.collect()
    assert limiter.in_flight(ns) == 0
    assert InflightLimiter(0).acquire(ns, Owner()) is not None  # 0: no cap
