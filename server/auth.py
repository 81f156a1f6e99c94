"""Bearer-token authentication for every route except `GET /health`.

A pure ASGI middleware rather than Starlette's `BaseHTTPMiddleware`: the latter wraps streaming responses in
its own task group, which delays client-disconnect detection (and so engine aborts) for SSE streams.
"""

from __future__ import annotations

import hmac
from collections.abc import Sequence

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import INVALID_REQUEST, error_body

# Probes (load balancers, Kubernetes) must be able to check liveness without a key.
_OPEN_ROUTES = {("GET", "/health"), ("HEAD", "/health")}


class ApiKeyMiddleware:
    def __init__(self, app: ASGIApp, api_keys: Sequence[str]) -> None:
        self.app = app
        # Compare bytes: compare_digest on str requires ASCII, and a non-ASCII header must not raise.
        self.keys = [key.encode() for key in api_keys if key]

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not self.keys:
            await self.app(scope, receive, send)
            return
        if (scope.get("method", "GET"), scope.get("path", "")) in _OPEN_ROUTES or self._authorized(scope):
            await self.app(scope, receive, send)
            return
        response = JSONResponse(
            error_body(
                "Incorrect API key provided: pass it as 'Authorization: Bearer <key>'.",
                type=INVALID_REQUEST,
                code="invalid_api_key",
            ),
            status_code=401,
            headers={"WWW-Authenticate": "Bearer"},
        )
        await response(scope, receive, send)

    def _authorized(self, scope: Scope) -> bool:
        header = b""
        for name, value in scope.get("headers", ()):
            if name == b"authorization":
                header = value
                break
        scheme, _, token = header.partition(b" ")
        if scheme.lower() != b"bearer" or not token:
            return False
        token = token.strip()
        # Check every key (no early exit) so timing does not reveal which key prefix matched.
        matched = False
        for key in self.keys:
            matched |= hmac.compare_digest(token, key)
        return matched
