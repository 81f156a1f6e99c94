"""OpenAI-shaped errors: the one exception routes raise, and the handlers that turn every failure
(validation, unknown route, bad JSON, unexpected exceptions) into `{"error": {message, type, param, code}}`.

Messages never repeat a field's value: a request's `cache_salt` (or any other field) must not leak into
responses or logs through an error message, and neither do the keys of a map the client sends (`logit_bias`,
`chat_template_kwargs`). Two kinds of input may appear, on purpose: the unknown model's name in a 404
(truncated to 100 characters, as OpenAI names it), and the words of the model's own chat template when it
refuses the messages (its `raise_exception(...)` text).
"""

from __future__ import annotations

import logging
from http import HTTPStatus
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine.errors import ContextLengthError

logger = logging.getLogger("brine.server")

INVALID_REQUEST = "invalid_request_error"
SERVER_ERROR = "server_error"
CACHE_SALT = "cache_salt"


class APIError(Exception):
    """Raised by routes; rendered as an OpenAI error response with `status`."""

    def __init__(
        self,
        message: str,
        *,
        status: int = 400,
        type: str = INVALID_REQUEST,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status = status
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers  # e.g. a 429's Retry-After

    def body(self) -> dict[str, Any]:
        return error_body(self.message, type=self.type, param=self.param, code=self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    message: str, *, type: str = INVALID_REQUEST, param: str | None = None, code: str | None = None
) -> dict[str, Any]:
    # All four keys are required by the schema (param and code may be null).
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


def bad_request(message: str, param: str | None = None, code: str | None = None) -> APIError:
    return APIError(message, status=400, param=param, code=code)


# Fields whose keys the client chooses: an error below one is reported at the field, not at the key.
_MAP_FIELDS = frozenset({"logit_bias", "chat_template_kwargs"})


def validation_error(exc: ValidationError | RequestValidationError) -> APIError:
    """A failed body validation as a 400, naming the offending top-level field as `param`.

    An invalid `cache_salt` wins over every other error, so that a request with a bad salt is always refused
    for its salt. Built from the error's location, type and message only (never `input`), so values are not
    echoed.
    """
    errors = exc.errors()
    if not errors:
        return bad_request("invalid request")
    first = next((e for e in errors if _loc(e)[:1] == [CACHE_SALT]), errors[0])
    loc = _loc(first)
    kind = first.get("type", "")
    if kind == "json_invalid":
        return bad_request("We could not parse the JSON body of your request.", code="invalid_json")
    if not loc and kind in ("missing", "model_attributes_type", "model_type", "dict_type"):
        return bad_request(
            "The request body must be a JSON object (sent with Content-Type: application/json).",
            code="invalid_json",
        )
    param = loc[0] if loc else None
    where = ".".join(loc) if loc else "request body"
    code = "invalid_cache_salt" if param == CACHE_SALT else None
    return bad_request(f"{where}: {first.get('msg', 'invalid value')}", param=param, code=code)


def _loc(error: Any) -> list[str]:
    loc = [str(part) for part in error.get("loc", ())]
    loc = loc[1:] if loc and loc[0] == "body" else loc  # FastAPI prefixes body errors with "body"
    for i, part in enumerate(loc):
        if part in _MAP_FIELDS:
            return loc[: i + 1]
    return loc


def context_length_exceeded(exc: ContextLengthError) -> APIError:
    """The one mapping of `ContextLengthError`, raised by the server's own check or by the engine's."""
    return bad_request(str(exc), exc.param, "context_length_exceeded")


def engine_not_running() -> APIError:
    """503 for every route that needs the engine once it has stopped (`/health` included)."""
    return APIError("The engine is not running.", status=503, type=SERVER_ERROR, code="engine_dead")


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(ContextLengthError)
    async def _context_length(_: Request, exc: ContextLengthError) -> JSONResponse:
        return context_length_exceeded(exc).response()

    @app.exception_handler(RequestValidationError)
    async def _request_validation(_: Request, exc: RequestValidationError) -> JSONResponse:
        # FastAPI's default is a 422 with its own shape; OpenAI clients expect a 400 with theirs.
        return validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        try:
            phrase = HTTPStatus(exc.status_code).phrase
        except ValueError:
            phrase = "error"
        code = phrase.lower().replace(" ", "_")
        message = exc.detail if isinstance(exc.detail, str) and exc.detail != phrase else phrase
        kind = SERVER_ERROR if exc.status_code >= 500 else INVALID_REQUEST
        return JSONResponse(
            error_body(message, type=kind, code=code), status_code=exc.status_code, headers=exc.headers
        )

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        # What UnexpectedErrorMiddleware cannot take: an exception raised in a middleware outside it.
        return _log_unexpected()


def _log_unexpected() -> JSONResponse:
    # A bug or an engine failure, never the client's input: log the traceback (the message of an exception
    # raised deep inside may contain request data, so it is not sent back).
    logger.exception("unhandled error while serving a request")
    return JSONResponse(error_body("internal server error", type=SERVER_ERROR), status_code=500)


class UnexpectedErrorMiddleware:
    """Answers an exception that no handler took with the 500 error body, and ends the request there.

    Why not only the `Exception` handler: Starlette runs that one in its outermost middleware, which sends the
    500 and then raises the exception again, to the server; uvicorn then closes the connection under a
    response it had sent as keep-alive, and a pooled client's next request on it, another and maybe valid one,
    failed with a connection reset. Installed innermost among the middlewares, so that the Messages routes'
    rewriting (server.messages_errors) still gives their 500 Anthropic's shape. A response already under way
    (a stream) cannot become a 500: that exception goes on, and its connection closes."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def tracking_send(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, tracking_send)
        except Exception:
            if started:
                raise
            await _log_unexpected()(scope, receive, send)
