"""The request-body cap: a body over `max_bytes` is refused with a 413 before it is buffered whole.

FastAPI reads and parses a typed body itself, with no limit, before any route code runs. This pure ASGI
middleware sits in front of it: it refuses a declared Content-Length over the cap at once, and otherwise reads
the body chunk by chunk (a chunked body declares no length), stopping at the first byte past the cap. A body
under the cap is handed on to the app as one message, and later `receive()` calls (disconnect detection) pass
straight through.
"""

from __future__ import annotations

from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from server.errors import APIError

# Far above any prompt a context window holds (a 128k-token prompt is about 1 MiB of JSON), far below what
# would exhaust memory or stall the event loop for long.
MAX_BODY_BYTES = 16 * 2**20
_BODY_METHODS = {"POST", "PUT", "PATCH"}


def too_large(limit: int) -> APIError:
    return APIError(
        f"The request body is larger than the {limit} bytes this server accepts.",
        status=413,
        code="request_too_large",
    )


class BodyLimitMiddleware:
    def __init__(
        self, app: ASGIApp, max_bytes: int = MAX_BODY_BYTES, path_limits: dict[str, int] | None = None
    ) -> None:
        """`path_limits`: lower caps for some paths (`/detokenize`: FastAPI parses a body on the event loop,
        ~20 ms per MB of token ids, before the route can count them)."""
        self.app = app
        self.max_bytes = max_bytes
        self.path_limits = dict(path_limits or {})

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in _BODY_METHODS:
            await self.app(scope, receive, send)
            return
        limit = self.path_limits.get(scope.get("path", ""), self.max_bytes)
        declared = ""
        for name, value in scope.get("headers", ()):
            if name == b"content-length":
                declared = value.decode("latin-1")
                break
        if declared.isdigit() and (len(declared) > 19 or int(declared) > limit):
            await too_large(limit).response()(scope, receive, send)
            return
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":
                # The client left while sending its body: 499, as the app answers any client gone mid-request.
                await Response(status_code=499)(scope, receive, send)
                return
            chunk = message.get("body", b"")
            size += len(chunk)
            if size > limit:
                await too_large(limit).response()(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        body: Message = {"type": "http.request", "body": b"".join(chunks), "more_body": False}
        await self.app(scope, _replay(body, receive), send)


def _replay(first: Message, receive: Receive) -> Receive:
    pending = [first]

    async def replayed() -> Message:
        return pending.pop() if pending else await receive()

    return replayed
