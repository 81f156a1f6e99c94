"""Helpers shared by the server tests: request bodies, SSE parsing, error-shape assertions."""

from __future__ import annotations

import json
from typing import Any

MODEL = "fake-model"


def chat_body(content: str = "hi", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "messages": [{"role": "user", "content": content}], "max_tokens": 8, **extra}


def completion_body(prompt: Any = "hello", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "prompt": prompt, "max_tokens": 8, **extra}


def sse_events(text: str) -> list[Any]:
    """The data of each SSE event, JSON-decoded ("[DONE]" kept as the string). Asserts the framing: every
    event is one `data: ` line followed by a blank line."""
    assert text.endswith("\n\n"), text[-50:]
    events = []
    for block in text.split("\n\n")[:-1]:
        assert block.startswith("data: ") and "\n" not in block, block
        data = block[len("data: ") :]
        events.append(data if data == "[DONE]" else json.loads(data))
    return events


def assert_error(response: Any, status: int, param: str | None = None, code: str | None = None) -> dict:
    assert response.status_code == status, response.text
    body = response.json()
    assert set(body) == {"error"}
    err = body["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert isinstance(err["message"], str) and err["message"]
    assert err["type"] == ("server_error" if status >= 500 else "invalid_request_error")
    if param is not None:
        assert err["param"] == param, err
    if code is not None:
        assert err["code"] == code, err
    return err


def http_scope(method: str, path: str, headers: list[tuple[bytes, bytes]] | tuple = ()) -> dict[str, Any]:
    """An ASGI HTTP scope, for driving the app without a server (what uvicorn would pass it)."""
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": "1.1",
        "method": method,
        "scheme": "http",
        "path": path,
        "raw_path": path.encode(),
        "query_string": b"",
        "root_path": "",
        "headers": [(b"host", b"test"), *headers],
        "client": ("127.0.0.1", 1234),
        "server": ("127.0.0.1", 80),
    }
