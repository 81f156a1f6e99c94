"""Reading a JSON request body: bad JSON, a non-object body, an invalid `cache_salt` and schema violations
all become 400s in the OpenAI error shape.

Routes parse bodies here instead of letting FastAPI do it so that the checks run in a fixed order (the salt
first: a request with a bad salt must never reach the engine, whatever else is wrong with it) and so that no
error message can echo a field's value.
"""

from __future__ import annotations

import json
from typing import Any, TypeVar

from fastapi import Request
from pydantic import BaseModel, ValidationError

from server.errors import APIError, bad_request, validation_error

MAX_CACHE_SALT_CHARS = 1024
# Far above any prompt a context window holds (a 128k-token prompt is about 1 MiB of JSON), far below what
# would exhaust memory or stall the event loop for long.
MAX_BODY_BYTES = 16 * 2**20
_SALT_CODE = "invalid_cache_salt"

M = TypeVar("M", bound=BaseModel)


async def read_body(request: Request) -> bytes:
    """The body, refused with a 413 once it passes the app's cap (`create_app(max_body_bytes=...)`).

    Checked against Content-Length first and again while reading (a chunked body declares no length), so
    an oversized body is never buffered whole: parsing and tokenizing it would stall every other request.
    """
    limit: int = getattr(request.app.state, "max_body_bytes", MAX_BODY_BYTES)
    declared = request.headers.get("content-length", "")
    if declared.isdigit() and (len(declared) > 19 or int(declared) > limit):
        raise _too_large(limit)
    chunks: list[bytes] = []
    size = 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > limit:
            raise _too_large(limit)
        chunks.append(chunk)
    return b"".join(chunks)


def _too_large(limit: int) -> APIError:
    return APIError(
        f"The request body is larger than the {limit} bytes this server accepts.",
        status=413,
        code="request_too_large",
    )


async def read_json_object(request: Request) -> dict[str, Any]:
    raw = await read_body(request)
    try:
        body = json.loads(raw)
    except (ValueError, RecursionError):
        # ValueError covers JSONDecodeError, bad UTF-8 and ints longer than Python's digit limit.
        raise bad_request("We could not parse the JSON body of your request.", code="invalid_json") from None
    if not isinstance(body, dict):
        raise bad_request("The request body must be a JSON object.", code="invalid_json")
    return body


def pop_cache_salt(body: dict[str, Any]) -> str | None:
    """Remove and return the request's salt; raise a 400 with param `cache_salt` if it is invalid.

    Valid: absent, or a non-empty string of at most 1024 characters. An explicit null is rejected rather than
    read as "no salt": a tenant whose salt came out null by mistake would otherwise silently share cache
    blocks with unsalted traffic. Messages describe the rule, never the value.
    """
    if "cache_salt" not in body:
        return None
    salt = body.pop("cache_salt")
    if not isinstance(salt, str):
        raise bad_request("cache_salt must be a string.", param="cache_salt", code=_SALT_CODE)
    if not salt:
        raise bad_request("cache_salt must not be empty.", param="cache_salt", code=_SALT_CODE)
    if len(salt) > MAX_CACHE_SALT_CHARS:
        raise bad_request(
            f"cache_salt must be at most {MAX_CACHE_SALT_CHARS} characters long.",
            param="cache_salt",
            code=_SALT_CODE,
        )
    return salt


def validate_model(model_cls: type[M], body: dict[str, Any]) -> M:
    try:
        return model_cls.model_validate(body)
    except ValidationError as exc:
        raise validation_error(exc) from None


async def parse_generation_request(request: Request, model_cls: type[M]) -> tuple[M, str | None]:
    body = await read_json_object(request)
    salt = pop_cache_salt(body)
    return validate_model(model_cls, body), salt


async def parse_request(request: Request, model_cls: type[M]) -> M:
    return validate_model(model_cls, await read_json_object(request))
