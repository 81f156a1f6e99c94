"""Every failure uses the OpenAI error shape; no input produces a 5xx; engine failures are reported."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import assert_error, chat_body, completion_body


def test_unknown_route_and_method(client: TestClient) -> None:
    assert_error(client.get("/v1/nothing"), 404, code="not_found")
    assert_error(client.post("/v2/chat/completions", json={}), 404)
    assert_error(client.get("/v1/chat/completions"), 405, code="method_not_allowed")


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize", "/detokenize"])
@pytest.mark.parametrize(
    "raw",
    [
        b"{not json",
        b"",
        b"[1, 2]",
        b'"text"',
        b"null",
        b"\xff\xfe",
        b"[" * 100_000,
        b'{"n": 1' + b"0" * 5000 + b"}",
    ],
)
def test_bad_bodies_are_400(client: TestClient, engine: FakeEngine, path: str, raw: bytes) -> None:
    r = client.post(path, content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400)
    assert engine.calls == []


@pytest.mark.parametrize(
    ("body", "param"),
    [
        ({"messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": 5}]}, "messages"),
        ({"temperature": "hot"}, "temperature"),
        ({"n": 1.5}, "n"),
        ({"stream": "perhaps"}, "stream"),
        ({"stream_options": 3}, "stream_options"),
        ({"chat_template_kwargs": []}, "chat_template_kwargs"),
    ],
)
def test_validation_errors_are_400_with_param(client: TestClient, body: dict, param: str) -> None:
    err = assert_error(client.post("/v1/chat/completions", json=chat_body() | body), 400, param)
    assert "hot" not in err["message"] and "perhaps" not in err["message"]  # values are not echoed


def test_nan_and_infinity_are_rejected(client: TestClient) -> None:
    for literal in (b"NaN", b"Infinity", b"-Infinity", b"1e999"):
        raw = b'{"model": "fake-model", "prompt": "x", "temperature": ' + literal + b"}"
        r = client.post("/v1/completions", content=raw, headers={"content-type": "application/json"})
        assert_error(r, 400, "temperature")


def test_unknown_model(client: TestClient, engine: FakeEngine) -> None:
    for path, body in (("/v1/chat/completions", chat_body()), ("/v1/completions", completion_body())):
        err = assert_error(client.post(path, json=body | {"model": "gpt-9"}), 404, "model", "model_not_found")
        assert "gpt-9" in err["message"]
    assert_error(client.get("/v1/models/gpt-9"), 404, code="model_not_found")
    assert engine.calls == []


def test_model_may_be_omitted(client: TestClient) -> None:
    body = chat_body()
    del body["model"]
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_engine_error_output_is_a_500(engine: FakeEngine, client: TestClient) -> None:
    engine.error_after = 1
    err = assert_error(client.post("/v1/completions", json=completion_body()), 500)
    assert "fake engine failure" not in err["message"]


def test_dead_engine(engine: FakeEngine, client: TestClient) -> None:
    assert client.get("/health").status_code == 200
    engine.healthy = False
    assert_error(client.get("/health"), 503, code="engine_dead")
    assert_error(client.post("/v1/chat/completions", json=chat_body()), 503, code="engine_dead")
    assert client.get("/v1/models").status_code == 200  # metadata still answers


def test_engine_dying_between_check_and_generate(engine: FakeEngine, client: TestClient) -> None:
    # is_healthy() said yes, then generate() raised EngineDeadError: still a clean 503.
    engine.is_healthy = lambda: True  # type: ignore[method-assign]
    engine.healthy = False
    assert_error(client.post("/v1/completions", json=completion_body()), 503, code="engine_dead")
