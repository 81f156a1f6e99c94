"""An exception no handler takes (a bug) is a 500 in the OpenAI error shape, that does not repeat the exception's
text, and it ends there: the server keeps the client's connection open for its next request
(server.errors.UnexpectedErrorMiddleware). Found by a probe: the Responses API's `input[0].role` sent as a list
was a 500 (since a 400), and uvicorn then closed the connection under a keep-alive response, so a pooled
client's next request on it, a valid one, failed with a connection reset."""

from __future__ import annotations

import asyncio
import json
import socket

import pytest
from fake_engine import FakeEngine
from fastapi import FastAPI
from fastapi.responses import StreamingResponse
from server_helpers import MODEL, http_scope
from server_thread import start_server

from server import supervise
from server.app import create_app

SECRET = "the exception's own words"


def _app(engine: FakeEngine) -> FastAPI:
    app = create_app(engine)

    @app.get("/boom")
    def boom() -> None:
        raise RuntimeError(SECRET)

    @app.get("/boom-midway")
    def boom_midway() -> StreamingResponse:
        def chunks():
            yield b"data: one\n\n"
            raise RuntimeError(SECRET)

        return StreamingResponse(chunks(), media_type="text/event-stream")

    return app


async def _get(app: FastAPI, path: str) -> list[dict]:
    sent: list[dict] = []

    async def receive() -> dict:
        await asyncio.sleep(3600)  # the client stays until the answer is sent
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = http_scope("GET", path)
    await app(scope, receive, send)  # returns: nothing reaches the server to close the connection for
    return sent


def test_an_unexpected_exception_is_a_500_that_ends_in_the_app(engine: FakeEngine, caplog) -> None:
    sent = asyncio.run(_get(_app(engine), "/boom"))
    assert sent[0]["type"] == "http.response.start" and sent[0]["status"] == 500
    body = json.loads(b"".join(m.get("body", b"") for m in sent[1:]))
    assert body == {
        "error": {"message": "internal server error", "type": "server_error", "param": None, "code": None}
    }
    assert (
        "unhandled error while serving a request" in caplog.text and SECRET in caplog.text
    )  # logged, not sent


def test_an_exception_inside_a_started_stream_still_reaches_the_server(engine: FakeEngine) -> None:
    # A response under way cannot turn into a 500: the server must close that connection.
    with pytest.raises(RuntimeError, match=SECRET):
        asyncio.run(_get(_app(engine), "/boom-midway"))


def _exchange(sock: socket.socket, path: str) -> bytes:
    """One GET on a kept-alive connection; the whole answer (its Content-Length), or what came before EOF."""
    sock.sendall(f"GET {path} HTTP/1.1\r\nHost: test\r\n\r\n".encode())
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        if not chunk:
            return data
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    length = next(
        int(line.split(b":")[1])
        for line in head.split(b"\r\n")
        if line.lower().startswith(b"content-length:")
    )
    while len(body) < length:
        chunk = sock.recv(65536)
        if not chunk:
            break
        body += chunk
    return head + b"\r\n\r\n" + body


def test_a_500_leaves_the_connection_open_for_the_next_request() -> None:
    engine = FakeEngine(model_name=MODEL)
    thread, _, url = start_server(engine, _app(engine))
    port = int(url.rsplit(":", 1)[1])
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            first = _exchange(sock, "/boom")
            assert first.startswith(b"HTTP/1.1 500") and SECRET.encode() not in first
            assert b"connection: close" not in first.lower()
            second = _exchange(sock, "/v1/models")  # the same connection: it was a keep-alive answer
            assert second.startswith(b"HTTP/1.1 200") and MODEL.encode() in second, second
    finally:
        engine.healthy = False  # the server stops when its engine dies (test_server_engine_death)
        thread.join(timeout=supervise.DRAIN_S + 10)
