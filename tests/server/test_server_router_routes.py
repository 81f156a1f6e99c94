"""The routes a cache-aware router calls (fake engine): server info, model info, KV event sources, render."""

from __future__ import annotations

from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import MODEL, chat_body, completion_body

from server.app import create_app
from server.tenancy import TenancyConfig
from server.tenants import key_hash

OPERATOR, TENANT = "operator-key", "sk-acme-key"
AUTH = {"Authorization": f"Bearer {OPERATOR}"}


def test_get_server_info(client: TestClient, engine: FakeEngine) -> None:
    info = client.get("/get_server_info").json()
    assert info["model_id"] == MODEL
    assert info["kv_block_size"] == engine.block_size
    assert info["max_model_len"] == engine.max_model_len
    assert info["num_gpu_blocks"] == engine.num_blocks
    assert info["instance_id"].startswith("brine-")
    # Two replicas (two apps) never share an instance id: a router keys each one's events by it.
    other = TestClient(create_app(FakeEngine(model_name=MODEL))).get("/get_server_info").json()
    assert other["instance_id"] != info["instance_id"]


def test_get_model_info_for_sglang_router(client: TestClient) -> None:
    info = client.get("/get_model_info").json()
    assert info["model_path"] == MODEL and info["is_generation"] is True


def test_kv_event_sources_empty_when_events_are_off(client: TestClient) -> None:
    r = client.get("/kv_event_sources")
    assert r.status_code == 200 and r.json() == {}


def test_kv_event_sources_lists_rank_zero(engine: FakeEngine) -> None:
    source = {"endpoint": "tcp://*:5557", "replay_endpoint": "tcp://*:5558", "topic": ""}
    engine.kv_event_sources = lambda: {"0": source}  # type: ignore[method-assign]
    assert TestClient(create_app(engine)).get("/kv_event_sources").json() == {"0": source}


def test_completion_render_returns_one_generate_request_per_prompt(
    client: TestClient, engine: FakeEngine
) -> None:
    body = completion_body(["hello", "bye!"], temperature=0.5, stream=True)
    r = client.post("/v1/completions/render", json=body)
    assert r.status_code == 200, r.text
    items = r.json()
    assert [i["token_ids"] for i in items] == [
        engine.tokenizer.encode("hello"),
        engine.tokenizer.encode("bye!"),
    ]
    for item in items:
        assert item["request_id"].startswith("cmpl-") and item["model"] == MODEL and item["stream"] is True
        assert item["sampling_params"]["temperature"] == 0.5 and item["sampling_params"]["max_tokens"] == 8
    assert not engine.calls, "render must not generate"


def test_chat_render_returns_the_templated_prompt(client: TestClient, engine: FakeEngine) -> None:
    tokens = client.post("/tokenize", json={"messages": [{"role": "user", "content": "hi"}]}).json()["tokens"]
    r = client.post("/v1/chat/completions/render", json=chat_body("hi"))
    assert r.status_code == 200, r.text
    item = r.json()
    assert item["token_ids"] == tokens and item["request_id"].startswith("chatcmpl-")
    assert not engine.calls


def test_render_refuses_what_the_route_refuses(client: TestClient) -> None:
    r = client.post("/v1/chat/completions/render", json=chat_body("hi", cache_salt=""))
    assert r.status_code == 400 and r.json()["error"]["param"] == "cache_salt"
    r = client.post("/v1/completions/render", json=completion_body("hi", model="other-model"))
    assert r.status_code == 404
    r = client.post("/v1/completions/render", json=completion_body("hi", max_tokens=10**9))
    assert r.status_code == 400
    r = client.post("/v1/completions/render", json=completion_body("hi", stop=[str(i) for i in range(5)]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop"  # --max-stop-strings (default 4)


def test_router_routes_need_a_key_and_are_operator_only(engine: FakeEngine) -> None:
    app = create_app(engine, api_keys=[OPERATOR], tenancy=TenancyConfig(tenants={key_hash(TENANT): "acme"}))
    client = TestClient(app)
    tenant = {"Authorization": f"Bearer {TENANT}"}
    for method, path, body in [
        ("GET", "/get_server_info", None),
        ("GET", "/get_model_info", None),
        ("GET", "/kv_event_sources", None),
        ("POST", "/v1/completions/render", completion_body("hi")),
        ("POST", "/v1/chat/completions/render", chat_body("hi")),
    ]:
        assert client.request(method, path, json=body).status_code == 401, path
        assert client.request(method, path, json=body, headers=tenant).status_code == 403, path
        assert client.request(method, path, json=body, headers=AUTH).status_code == 200, path
