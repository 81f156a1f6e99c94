"""Errors in Anthropic's shape on the Messages routes: `{"type": "error", "error": {"type": ..., "message":
...}}`, with Anthropic's error types for each status (`invalid_request_error`, `authentication_error`,
`permission_error`, `not_found_error`, `request_too_large`, `rate_limit_error`, `api_error`).

Every failure already becomes an OpenAI-shaped JSON error somewhere (`server.errors`' handlers, the auth and
body-limit middlewares); `AnthropicErrorMiddleware`, outermost, rewrites those answers on `/v1/messages*`,
so that every way a request can fail there, including the ones refused before any route runs, speaks the
client's API. The OpenAI error's `param` is folded into the message (Anthropic's errors have no `param`).
"""

from __future__ import annotations

import json
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

MESSAGES_PATH = "/v1/messages"
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    413: "request_too_large",
    429: "rate_limit_error",
    529: "overloaded_error",
}


def anthropic_error(status: int, message: str) -> dict[str, Any]:
    kind = _TYPES.get(status) or ("api_error" if status >= 500 else "invalid_request_error")
    return {"type": "error", "error": {"type": kind, "message": message}}


def is_messages_path(path: str) -> bool:
    return path == MESSAGES_PATH or path.startswith(MESSAGES_PATH + "/")


def _rewrite(status: int, body: bytes) -> bytes | None:
    """The Anthropic form of an OpenAI error body; None if `body` is not one."""
    try:
        data = json.loads(body)
    except ValueError:
        return None
    err = data.get("error") if isinstance(data, dict) else None
    if not isinstance(err, dict) or not isinstance(err.get("message"), str):
        return None
    message, param = err["message"], err.get("param")
    if isinstance(param, str) and param and not message.startswith(param):
        message = f"{param}: {message}"
    return json.dumps(anthropic_error(status, message), ensure_ascii=False).encode()


class AnthropicErrorMiddleware:
    """Rewrites JSON error answers (status >= 400) on the Messages routes; everything else passes as it is."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not is_messages_path(scope.get("path", "")):
            await self.app(scope, receive, send)
            return
        start: Message | None = None
        chunks: list[bytes] = []

        async def rewriting_send(message: Message) -> None:
            nonlocal start
            if message["type"] == "http.response.start":
                kind = dict(message.get("headers", ())).get(b"content-type", b"")
                json_body = kind.startswith(b"application/json")
                if message["status"] >= 400 and json_body:
                    start = message  # held until the whole body is here
                    return
                await send(message)
                return
            if start is None or message["type"] != "http.response.body":
                await send(message)
                return
            chunks.append(message.get("body", b""))
            if message.get("more_body", False):
                return
            body = b"".join(chunks)
            new = _rewrite(start["status"], body)
            if new is not None:
                body = new
            headers = [(k, v) for k, v in start.get("headers", ()) if k != b"content-length"]
            headers.append((b"content-length", str(len(body)).encode()))
            await send({**start, "headers": headers})
            await send({"type": "http.response.body", "body": body})

        await self.app(scope, receive, rewriting_send)
