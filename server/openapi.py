"""What `GET /openapi.json` (and the `/docs` page built from it) publishes beyond FastAPI's defaults.

Request schemas come from the routes' pydantic bodies (`server.protocol`). This module adds the error
responses in OpenAI's shape, which is what the server really sends, and drops FastAPI's 422
`HTTPValidationError`, which it never sends (validation errors are 400s, `server.errors`).
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None
    code: str | None


class ErrorResponse(BaseModel):
    error: ErrorInfo


def _error(description: str) -> dict[str, Any]:
    return {"model": ErrorResponse, "description": description}


# The errors every body-taking route may answer with (404: an unknown `model`).
BODY_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _error("Invalid request: `param` names the offending field."),
    401: _error("Missing or wrong API key (when the server has `--api-key`)."),
    404: _error("The requested model is not served here."),
    413: _error("The request body is larger than the server accepts."),
}
GENERATION_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "description": "The completion object, or with `stream: true` server-sent events of chunk objects "
        "ending with `data: [DONE]`.",
        "content": {"text/event-stream": {}},
    },
    **BODY_ERRORS,
    503: _error("The engine is not running."),
}


def install_openapi(app: FastAPI) -> None:
    """Replace `app.openapi` with FastAPI's own schema, minus the 422 responses it documents by default."""
    base = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is None:
            schema = base()
            for item in schema.get("paths", {}).values():
                for operation in item.values():
                    operation.get("responses", {}).pop("422", None)
            schemas = schema.get("components", {}).get("schemas", {})
            for name in ("HTTPValidationError", "ValidationError"):
                schemas.pop(name, None)
            app.openapi_schema = schema
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
