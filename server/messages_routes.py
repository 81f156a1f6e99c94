"""Registers Anthropic's Messages API on the app: `POST /v1/messages`, `POST /v1/messages/count_tokens`, and
the middleware that gives their errors Anthropic's shape (`server.messages_errors`). Auth is the app's
(`server.auth`: `x-api-key` or `Authorization: Bearer`); `anthropic-version` is accepted and ignored.
"""

from __future__ import annotations

from fastapi import FastAPI, Request
from starlette.responses import Response

from server.engine_client import EngineClient
from server.errors import engine_not_running
from server.messages_errors import AnthropicErrorMiddleware
from server.messages_protocol import (
    COUNT_TOKENS_RESPONSES,
    MESSAGES_RESPONSES,
    CountTokensRequest,
    MessagesRequest,
    TokenCount,
)
from server.serving_messages import count_message_tokens, create_message


def install_messages_routes(app: FastAPI, engine: EngineClient) -> None:
    """Call after every other middleware is added: the error rewriter must be outermost, to also rewrite the
    answers of the auth and body-limit middlewares."""
    app.add_middleware(AnthropicErrorMiddleware)

    @app.post("/v1/messages", operation_id="createMessage", responses=MESSAGES_RESPONSES, tags=["anthropic"])
    async def messages(body: MessagesRequest, request: Request) -> Response:
        if not engine.is_healthy():
            raise engine_not_running()
        return await create_message(engine, body, request)

    @app.post(
        "/v1/messages/count_tokens",
        operation_id="countMessageTokens",
        responses=COUNT_TOKENS_RESPONSES,
        response_model=TokenCount,
        tags=["anthropic"],
    )
    async def count_tokens(body: CountTokensRequest, request: Request) -> dict:
        return await count_message_tokens(engine, body, request)
