"""API-key authentication (`Authorization: Bearer <key>`, or `x-api-key: <key>` as Anthropic's clients send it)
for every route except `GET`/`HEAD /health`, and who the caller is.

Two kinds of key: the operator's (`--api-key` / `BRINE_API_KEY`), which open every route, and tenants' (from
`--tenants`, matched by the SHA-256 of the key), which open only the routes a tenant needs and put the request
in that tenant's cache namespace: the tenant id is left in the ASGI scope under `TENANT_SCOPE_KEY` for the
routes to read. Any other route answers a tenant with a 403: /metrics shows every tenant's traffic, and a
global prefix-cache reset would let one tenant flush (and then time) everyone's cache.

A pure ASGI middleware rather than Starlette's `BaseHTTPMiddleware`: the latter wraps streaming responses in
its own task group, which delays client-disconnect detection (and so engine aborts) for SSE streams.

Only HTTP gets through (and `lifespan`, the server's own start/stop messages): a WebSocket is closed before
it is accepted, whatever its headers, and any other scope type is refused, so a route added later cannot be
reached around the key check.
"""

from __future__ import annotations

import hashlib
import hmac
from collections.abc import Mapping, Sequence

from starlette.responses import JSONResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from server.errors import INVALID_REQUEST, error_body

TENANT_SCOPE_KEY = "brine.tenant"
# Probes (load balancers, Kubernetes) must be able to check liveness without a key.
_OPEN_ROUTES = {("GET", "/health"), ("HEAD", "/health")}
# What a tenant's key may reach (any method: a wrong one still gets its 405). Everything else is the
# operator's, including routes added later: a new route is closed to tenants until it is listed here.
_TENANT_PATHS = frozenset(
    {"/v1/chat/completions", "/v1/completions", "/v1/models", "/tokenize", "/detokenize", "/version",
     "/reset_prefix_cache", "/health", "/openapi.json", "/docs",
     "/v1/responses"}
)  # fmt: skip
# Anthropic's Messages API (server.messages_routes).
_MESSAGES_PATHS = frozenset({"/v1/messages", "/v1/messages/count_tokens"})
_TENANT_PATH_PREFIXES = ("/v1/models/", "/v1/responses/")


def tenant_may_use(path: str) -> bool:
    return path in _TENANT_PATHS or path.startswith(_TENANT_PATH_PREFIXES) or path in _MESSAGES_PATHS


class ApiKeyMiddleware:
    def __init__(
        self, app: ASGIApp, api_keys: Sequence[str], tenants: Mapping[str, str] | None = None
    ) -> None:
        """`api_keys`: the operator's keys. `tenants`: {hex SHA-256 of a key: tenant id}; None when the server
        has no tenants (then a request needs an operator key, and only one when there are any)."""
        self.app = app
        # Compare bytes: compare_digest on str requires ASCII, and a non-ASCII header must not raise.
        self.keys = [key.encode() for key in api_keys if key]
        self.tenants = dict(tenants) if tenants is not None else None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self.app(scope, receive, send)
            return
        if scope["type"] == "websocket":
            await receive()  # websocket.connect
            # 1008: policy violation. Closing before accepting makes the server answer the handshake with a 403.
            await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] != "http":
            raise RuntimeError(f"unsupported ASGI scope type {scope['type']!r}")
        if not self.keys and self.tenants is None:
            await self.app(scope, receive, send)
            return
        if (scope.get("method", "GET"), scope.get("path", "")) in _OPEN_ROUTES:
            await self.app(scope, receive, send)
            return
        token = _bearer_token(scope)
        operator, tenant = self._identify(token) if token else (False, None)
        if operator:
            await self.app(scope, receive, send)
            return
        if tenant is None:
            await _deny(scope, receive, send, 401)
            return
        if not tenant_may_use(scope.get("path", "")):
            await _deny(scope, receive, send, 403)
            return
        scope[TENANT_SCOPE_KEY] = tenant
        await self.app(scope, receive, send)

    def _identify(self, token: bytes) -> tuple[bool, str | None]:
        """(is it an operator key, the tenant it belongs to)."""
        # Check every operator key (no early exit) so timing does not reveal which key prefix matched.
        operator = False
        for key in self.keys:
            operator |= hmac.compare_digest(token, key)
        # A tenant key is found by its SHA-256: the lookup's timing depends on the digest, never on how much
        # of the key was right.
        tenant = self.tenants.get(hashlib.sha256(token).hexdigest()) if self.tenants else None
        return operator, tenant


def _bearer_token(scope: Scope) -> bytes:
    """The key of `Authorization: Bearer <key>`, else of `x-api-key: <key>` (Anthropic's clients send it)."""
    header = api_key = b""
    for name, value in scope.get("headers", ()):
        if name == b"authorization" and not header:
            header = value
        elif name == b"x-api-key" and not api_key:
            api_key = value
    scheme, _, token = header.partition(b" ")
    if scheme.lower() == b"bearer" and token.strip():
        return token.strip()
    return api_key.strip()


async def _deny(scope: Scope, receive: Receive, send: Send, status: int) -> None:
    if status == 401:
        body = error_body(
            "Incorrect API key provided: pass it as 'Authorization: Bearer <key>' or 'x-api-key: <key>'.",
            type=INVALID_REQUEST,
            code="invalid_api_key",
        )
        response = JSONResponse(body, status_code=401, headers={"WWW-Authenticate": "Bearer"})
    else:
        body = error_body(
            "This route is the server operator's: a tenant's API key cannot use it.",
            type=INVALID_REQUEST,
            code="permission_denied",
        )
        response = JSONResponse(body, status_code=status)
    await response(scope, receive, send)
