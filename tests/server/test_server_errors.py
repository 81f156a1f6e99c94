"""Every failure uses the OpenAI error shape; no input produces a 5xx; engine failures are reported."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import assert_error, chat_body, completion_body

from server.app import create_app
from server.body_limit import MAX_BODY_BYTES


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


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/tokenize"])
def test_huge_body_is_413_before_parsing(engine: FakeEngine, path: str) -> None:
    # Without a cap one request could make the server buffer, parse and tokenize gigabytes: every tenant stalls.
    client = TestClient(create_app(engine, max_body_bytes=1000))
    body = completion_body("x" * 2000) | chat_body("x" * 2000)
    assert_error(client.post(path, json=body), 413, code="request_too_large")

    def chunked() -> Iterator[bytes]:  # no content-length: the cap must hold while reading
        yield b'{"prompt": "'
        yield b"x" * 2000
        yield b'"}'

    r = client.post(path, content=chunked(), headers={"content-type": "application/json"})
    assert_error(r, 413, code="request_too_large")
    assert engine.calls == []
    # Bodies under the cap still work.
    small = {"prompt": "x"} if path == "/tokenize" else completion_body("x") | chat_body("x")
    assert client.post(path, json=small).status_code == 200


def test_default_body_cap_leaves_room_for_long_prompts(client: TestClient) -> None:
    # A long but sane body (1 MiB of padding) is not refused by the default cap.
    raw = b'{"model": "fake-model", "prompt": "hi", "max_tokens": 2' + b" " * 2**20 + b"}"
    assert client.post("/v1/completions", content=raw).status_code == 200


def test_default_body_cap(client: TestClient, engine: FakeEngine) -> None:
    raw = b'{"model": "fake-model", "prompt": "hi", "max_tokens": 2' + b" " * MAX_BODY_BYTES + b"}"
    assert_error(client.post("/v1/completions", content=raw), 413, code="request_too_large")
    assert engine.calls == []
