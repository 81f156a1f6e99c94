"""SSE framing of both generation routes, errors after a stream started, and client disconnects."""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import assert_error, chat_body, completion_body, sse_events

from server.app import create_app


def _stream(client: TestClient, path: str, body: dict[str, Any]) -> list[Any]:
    r = client.post(path, json={**body, "stream": True})
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/event-stream")
    events = sse_events(r.text)
    assert events[-1] == "[DONE]" and "[DONE]" not in events[:-1]
    return events[:-1]


def test_chat_stream_framing(client: TestClient) -> None:
    body = chat_body(max_tokens=5, temperature=0, stream_options={"include_usage": True})
    events = _stream(client, "/v1/chat/completions", body)
    ids = {e["id"] for e in events}
    assert len(ids) == 1 and all(e["object"] == "chat.completion.chunk" for e in events)
    first, *middle, finish, usage = events
    assert first["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": ""}, "logprobs": None, "finish_reason": None}
    ]
    assert middle and all(c["choices"][0]["finish_reason"] is None for c in middle)
    assert all(set(c["choices"][0]["delta"]) == {"content"} for c in middle)
    assert finish["choices"] == [{"index": 0, "delta": {}, "logprobs": None, "finish_reason": "length"}]
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 5
    assert usage["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}
    assert all("usage" not in e for e in events[:-1])  # absent, not null, on ordinary chunks


def test_streamed_text_equals_non_streamed(client: TestClient) -> None:
    for path, body, key in (
        ("/v1/chat/completions", chat_body("same", max_tokens=12, temperature=0, stop="o"), "message"),
        ("/v1/completions", completion_body("same", max_tokens=12, temperature=0, echo=True), "text"),
    ):
        full = client.post(path, json=body).json()["choices"][0]
        want = full["message"]["content"] if key == "message" else full["text"]
        got = ""
        for e in _stream(client, path, body):
            for c in e["choices"]:
                got += c["delta"].get("content") or "" if key == "message" else c["text"]
        assert got == want and want


def test_chat_stream_n2_logprobs(client: TestClient) -> None:
    body = chat_body(n=2, max_tokens=3, logprobs=True, top_logprobs=1)
    events = _stream(client, "/v1/chat/completions", body)
    roles = [e["choices"][0]["index"] for e in events if "role" in e["choices"][0]["delta"]]
    assert roles == [0, 1]
    finishes = sorted(e["choices"][0]["index"] for e in events if e["choices"][0]["finish_reason"])
    assert finishes == [0, 1]
    content = [e["choices"][0] for e in events if e["choices"][0]["delta"].get("content")]
    assert all(len(c["logprobs"]["content"]) == 1 for c in content)
    assert all(e["choices"] for e in events)  # no usage chunk unless asked


def test_completion_stream_framing(client: TestClient) -> None:
    body = completion_body(["a", "b"], max_tokens=2, stream_options={"include_usage": True})
    events = _stream(client, "/v1/completions", body)
    assert all(e["object"] == "text_completion" for e in events)
    *chunks, usage = events
    finishes = {c["choices"][0]["index"]: c["choices"][0]["finish_reason"] for c in chunks}
    assert finishes == {0: "length", 1: "length"}
    assert usage["choices"] == [] and usage["usage"]["completion_tokens"] == 4


def test_streamed_usage_reports_the_engines_cached_tokens(client: TestClient) -> None:
    # The benchmark client reads exactly this value from streamed completions.
    prefix = "the same long prefix, once more " * 3
    for path, make in (("/v1/completions", completion_body), ("/v1/chat/completions", chat_body)):
        opts = {"stream": True, "stream_options": {"include_usage": True}}
        for tail, expect_hit in (("one", False), ("two", True)):
            usage = _stream(client, path, make(prefix + tail, **opts))[-1]["usage"]
            full = client.post(path, json=make(prefix + tail)).json()["usage"]  # same prompt, not streamed
            cached = usage["prompt_tokens_details"]["cached_tokens"]
            assert (cached >= len(prefix) - 4) if expect_hit else cached == 0, (path, usage)
            assert full["prompt_tokens_details"]["cached_tokens"] >= len(prefix) - 4
            assert usage["prompt_tokens"] == full["prompt_tokens"]
    both = _stream(client, "/v1/completions", completion_body([prefix + "x", prefix + "y"], **opts))[-1][
        "usage"
    ]
    assert both["prompt_tokens_details"]["cached_tokens"] >= 2 * (len(prefix) - 4)  # summed over prompts


def test_error_before_stream_is_a_plain_400(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json=chat_body("x" * 300, stream=True))
    assert_error(r, 400, code="context_length_exceeded")


def test_error_after_stream_started(engine: FakeEngine, client: TestClient) -> None:
    engine.error_after = 2
    events = _stream(client, "/v1/chat/completions", chat_body(max_tokens=10))
    assert events[0]["choices"][0]["delta"]["role"] == "assistant"
    err = events[-1]["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "server_error"
    assert "fake engine failure" not in err["message"]  # engine internals stay in the log


async def _asgi_post(app: Any, path: str, body: dict, *, disconnect_after_bodies: int) -> list[dict]:
    """Drive the ASGI app by hand so the client can vanish mid-response (TestClient cannot)."""
    sent: list[dict] = []
    gone = asyncio.Event()
    delivered = False

    async def receive() -> dict:
        nonlocal delivered
        if not delivered:
            delivered = True
            return {"type": "http.request", "body": json.dumps(body).encode(), "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)
        if sum(m["type"] == "http.response.body" for m in sent) >= disconnect_after_bodies:
            gone.set()

    if disconnect_after_bodies == 0:
        gone.set()
    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.3"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json"), (b"host", b"test")],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 80),
    }
    await asyncio.wait_for(app(scope, receive, send), timeout=10)
    return sent


# The server's part of a disconnect is to stop consuming the engine's stream before it finished (the fake
# records that as `aborted`); that the real engine then frees the blocks is tests/engine/test_async_engine.py's
# and tests/e2e/test_e2e_disconnect.py's claim, not something the fake's own bookkeeping could show.


async def test_disconnect_mid_stream_aborts_the_engine_request() -> None:
    engine = FakeEngine(step_delay=0.01)
    app = create_app(engine)
    body = chat_body(max_tokens=200, stream=True)
    sent = await _asgi_post(app, "/v1/chat/completions", body, disconnect_after_bodies=3)
    assert engine.calls and engine.aborted == [engine.calls[0].request_id]
    received = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
    assert b"[DONE]" not in received  # it really was cut off mid-stream


async def test_disconnect_while_waiting_aborts() -> None:
    engine = FakeEngine(step_delay=0.01)
    app = create_app(engine)
    for path, body in (
        ("/v1/chat/completions", chat_body(max_tokens=200)),
        ("/v1/completions", completion_body(["a", "b"], max_tokens=200)),
    ):
        engine.calls.clear()
        engine.aborted.clear()
        await _asgi_post(app, path, body, disconnect_after_bodies=0)
        assert engine.calls
        assert sorted(engine.aborted) == sorted(c.request_id for c in engine.calls)


async def test_finished_stream_aborts_nothing() -> None:
    engine = FakeEngine()
    app = create_app(engine)
    sent = await _asgi_post(
        app, "/v1/completions", completion_body(stream=True), disconnect_after_bodies=10**6
    )
    assert sent[0]["status"] == 200 and engine.aborted == []


async def test_disconnect_while_sending_the_body_is_not_a_server_error(
    caplog: pytest.LogCaptureFixture,
) -> None:
    engine = FakeEngine()
    sent: list[dict] = []
    messages = [
        {"type": "http.request", "body": b'{"prompt": "hel', "more_body": True},
        {"type": "http.disconnect"},
    ]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = {
        "type": "http",
        "asgi": {"version": "3.0", "spec_version": "2.4"},
        "http_version": "1.1",
        "method": "POST",
        "scheme": "http",
        "path": "/v1/completions",
        "raw_path": b"/v1/completions",
        "query_string": b"",
        "root_path": "",
        "headers": [(b"content-type", b"application/json")],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 80),
    }
    await asyncio.wait_for(create_app(engine)(scope, receive, send), timeout=10)
    assert sent[0]["status"] < 500 and engine.calls == []
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]  # a client leaving is no bug
