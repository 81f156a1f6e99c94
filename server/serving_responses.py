"""`POST /v1/responses`, `GET /v1/responses/{id}` and `DELETE /v1/responses/{id}`: OpenAI's Responses API on the
chat path.

A request becomes a chat request (`server.responses_input`), which `prepare_chat` checks, renders and turns
into sampling params exactly as `/v1/chat/completions` would: the same limits, tenancy, template, forced and
Hermes-style tool calls, structured outputs. Errors name the Responses field (`input`, `max_output_tokens`,
`text`) instead of chat's. The chat deltas of the one sequence become output items and events in
`server.responses_events`.

Stored responses (`store`, true by default as on OpenAI) live in `server.response_store`, under the
request's cache namespace (tenant, gateway header, `cache_salt`): `previous_response_id`, `GET` and `DELETE`
see only their own namespace's responses, and anyone else's id is exactly a missing one (400
`previous_response_not_found` on create, 404 on `GET` / `DELETE`). `GET` and `DELETE` have no body, so a
salted response is reached with `?cache_salt=` (query strings are cut from the access log, `server.serve`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

from fastapi import FastAPI, Query, Request
from pydantic import ValidationError
from starlette.responses import Response

from engine.errors import ContextLengthError
from server.engine_client import EngineClient
from server.errors import SERVER_ERROR, APIError, bad_request, context_length_exceeded, engine_not_running
from server.errors import validation_error as pydantic_error
from server.generation import OutputStream
from server.openapi import BODY_ERRORS, GENERATION_RESPONSES
from server.protocol import MAX_CACHE_SALT_CHARS, ChatCompletionRequest
from server.response_store import ResponseStore
from server.responses import now
from server.responses_events import ResponseBuilder, item_id
from server.responses_input import chat_messages, chat_request, check_unsupported, input_items
from server.responses_protocol import DeletedResponse, ResponseObject, ResponsesRequest
from server.serving_chat import ChatGeneration, PreparedChat, prepare_chat
from server.tenancy import request_namespace
from server.text_check import check_text
from server.tool_parsers import supports_hermes_tools

logger = logging.getLogger("brine.server")
# Chat's names for the fields a Responses request spells otherwise.
_PARAMS = {
    "messages": "input",
    "max_completion_tokens": "max_output_tokens",
    "max_tokens": "max_output_tokens",
    "response_format": "text",
}


def _renamed(exc: APIError) -> APIError:
    if exc.param in _PARAMS:
        # e.g. "The chat template could not render these messages" (server.prompts)
        exc.message = exc.message.replace("these messages", "this input")
        exc.message = exc.message.replace(exc.param, _PARAMS[exc.param])
        exc.param = _PARAMS[exc.param]
    exc.message = exc.message.replace("max_completion_tokens", "max_output_tokens")
    return exc


def sse_frame(event: dict[str, Any]) -> str:
    # OpenAI names each event's type on an `event:` line too; the SDK reads either.
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"


def cache_write_tokens(engine: EngineClient, num_prompt_tokens: int, num_cached: int) -> int:
    """Prompt tokens this request computed and left in the prefix cache: those of its full blocks (only
    full blocks are hashed, `kv_cache`) that were not already cached."""
    if not engine.enable_prefix_caching:
        return 0
    full = num_prompt_tokens // engine.block_size * engine.block_size
    return max(full - num_cached, 0)


class ResponseGeneration(ChatGeneration):
    """One response: the chat generation's deltas folded into output items, returned whole or streamed."""

    def __init__(
        self,
        engine: EngineClient,
        prepared: PreparedChat,
        req: ResponsesRequest,
        store: ResponseStore,
        items: list[dict[str, Any]],
    ) -> None:
        super().__init__(engine, prepared)
        self.id = item_id("resp")
        self.req = req
        self.store = store
        self.items = items  # the conversation up to this response: previous items, then this input
        self.builder = ResponseBuilder()

    # ---- collecting (ChatGeneration's `_collect` calls these) ---------------------------------------------

    def add(self, prompt: int, out: Any, c: Any) -> None:
        for chunk in self.deltas(prompt, out, c):
            self.builder.feed(chunk)

    def body(self) -> dict[str, Any]:
        self.builder.finish()
        return self._finished()

    # ---- the response object ---------------------------------------------------------------------------

    def snapshot(self, status: str, **extra: Any) -> dict[str, Any]:
        req = self.req
        fmt = req.text.format if req.text is not None else None
        return {
            "id": self.id,
            "object": "response",
            "created_at": self.created,
            "status": status,
            "background": False,
            "error": None,
            "incomplete_details": None,
            "instructions": req.instructions,
            "max_output_tokens": req.max_output_tokens,
            "metadata": req.metadata or {},
            "model": self.model,
            "output": [],
            "parallel_tool_calls": bool(req.parallel_tool_calls),
            "previous_response_id": req.previous_response_id,
            "prompt_cache_key": req.prompt_cache_key,
            "prompt_cache_retention": req.prompt_cache_retention,
            "store": bool(req.store),
            "temperature": 1.0 if req.temperature is None else req.temperature,
            "top_p": 1.0 if req.top_p is None else req.top_p,
            "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"}},
            "tool_choice": req.tool_choice or "auto",
            "tools": req.tools or [],
            "truncation": "disabled",
            "usage": None,
            "user": req.user,
            **extra,
        }

    def response_usage(self) -> dict[str, Any]:
        prompt, cached = len(self.prepared.prompts[0]), self.cached[0]
        return {
            "input_tokens": prompt,
            "input_tokens_details": {
                "cached_tokens": cached,
                "cache_write_tokens": cache_write_tokens(self.engine, prompt, cached),
            },
            "output_tokens": self.num_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt + self.num_tokens,
        }

    def _finished(self) -> dict[str, Any]:
        """The final response object; stored when the request asked for it."""
        cut = self.builder.finish_reason == "length"
        response = self.snapshot(
            "incomplete" if cut else "completed",
            incomplete_details={"reason": "max_output_tokens"} if cut else None,
            output=self.builder.output,
            usage=self.response_usage(),
            completed_at=now(),
        )
        if self.req.store:
            self.store.put(self.id, self.prepared.namespace, response, [*self.items, *self.builder.output])
        return response

    # ---- streaming (Generation.respond streams this) ---------------------------------------------------

    async def sse(self, stream: OutputStream, include_usage: bool) -> AsyncIterator[str]:
        """The event stream. An error once it started can no longer change the status: it becomes an `error`
        event and `response.failed`."""
        b = self.builder
        try:
            try:
                yield sse_frame(b.lifecycle("response.created", self.snapshot("in_progress")))
                yield sse_frame(b.lifecycle("response.in_progress", self.snapshot("in_progress")))
                async for p, out in stream:
                    for c in self._outputs(p, out):
                        for chunk in self.deltas(p, out, c):
                            for event in b.feed(chunk):
                                yield sse_frame(event)
                for event in b.finish():
                    yield sse_frame(event)
                final = self._finished()
                kind = "response.completed" if final["status"] == "completed" else "response.incomplete"
                yield sse_frame(b.lifecycle(kind, final))
            except Exception as exc:
                if isinstance(exc, APIError):
                    error = exc
                else:
                    logger.exception("error while streaming a response")
                    error = APIError("internal server error", status=500, type=SERVER_ERROR)
                yield sse_frame(b.event("error", code=error.code, message=error.message, param=error.param))
                failed = self.snapshot(
                    "failed", output=b.output, error={"code": "server_error", "message": error.message}
                )
                yield sse_frame(b.lifecycle("response.failed", failed))
        finally:
            await stream.close()


def _check_auto_tools(engine: EngineClient, chat: ChatCompletionRequest) -> None:
    # Chat's own message names chat's tool_choice shapes; this one names the Responses API's.
    if chat.tools and chat.tool_choice in (None, "auto") and not supports_hermes_tools(engine.tokenizer):
        raise bad_request(
            'tool_choice "auto" (the default with tools) is not supported: this model\'s chat template has no '
            'tool-call format. Send tool_choice "required" or {"type": "function", "name": ...} to force a '
            'call, or "none".',
            "tool_choice",
        )


async def create_response(
    engine: EngineClient, store: ResponseStore, req: ResponsesRequest, request: Request
) -> Response:
    try:
        check_text(req)  # first, as on chat: a lone surrogate cannot even be named back
        check_unsupported(req)
        namespace = request_namespace(request, req.cache_salt)
        history: list[dict[str, Any]] = []
        if req.previous_response_id is not None:
            entry = store.get(req.previous_response_id, namespace)
            if entry is None:  # missing, expired, or another namespace's: the same answer
                raise bad_request(
                    "Previous response not found (it may have expired, or was made under another tenant or "
                    "cache_salt).",
                    "previous_response_id",
                    "previous_response_not_found",
                )
            history = entry.items
        items = [*history, *input_items(req)]
        try:
            chat = chat_request(req, chat_messages(items))
        except ValidationError as exc:
            raise pydantic_error(exc) from None
        _check_auto_tools(engine, chat)
        prepared = await prepare_chat(engine, chat, request)
        generation = ResponseGeneration(engine, prepared, req, store, items)
        return await generation.respond(request, bool(req.stream))
    except APIError as exc:
        raise _renamed(exc) from None
    except ContextLengthError as exc:
        raise _renamed(context_length_exceeded(exc)) from None


def _salt(cache_salt: str | None) -> str | None:
    if cache_salt is not None and not 1 <= len(cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise bad_request(
            f"cache_salt must be 1 to {MAX_CACHE_SALT_CHARS} characters.", "cache_salt", "invalid_cache_salt"
        )
    return cache_salt


def _not_found() -> APIError:
    return APIError("No response with this id was found.", status=404, param="response_id", code="not_found")


_SALT_QUERY = Query(
    None,
    description="The cache_salt the response was created with, if any: stored responses belong to the "
    "namespace (tenant, gateway header, cache_salt) that made them.",
)
_STORED_ERRORS = {**BODY_ERRORS, 404: {**BODY_ERRORS[404], "description": "No such response here."}}
_CREATED = {
    **GENERATION_RESPONSES,
    200: {
        "model": ResponseObject,
        "description": "The response, or with `stream: true` server-sent events (`event:` and `data:` lines, "
        "each event with its `sequence_number`) ending with `response.completed` or `response.incomplete`.",
        "content": {"text/event-stream": {}},
    },
}


def install_responses_routes(app: FastAPI, engine: EngineClient, store: ResponseStore) -> None:
    app.state.response_store = store

    @app.post("/v1/responses", operation_id="createResponse", responses=_CREATED)
    async def create(body: ResponsesRequest, request: Request) -> Response:
        if not engine.is_healthy():
            raise engine_not_running()
        return await create_response(engine, store, body, request)

    @app.get(
        "/v1/responses/{response_id}",
        operation_id="getResponse",
        responses={**_STORED_ERRORS, 200: {"model": ResponseObject, "description": "The stored response."}},
    )
    async def retrieve(response_id: str, request: Request, cache_salt: str | None = _SALT_QUERY) -> dict:
        entry = store.get(response_id, request_namespace(request, _salt(cache_salt)))
        if entry is None:
            raise _not_found()
        return entry.response

    @app.delete(
        "/v1/responses/{response_id}",
        operation_id="deleteResponse",
        responses={**_STORED_ERRORS, 200: {"model": DeletedResponse, "description": "Forgotten."}},
    )
    async def delete(response_id: str, request: Request, cache_salt: str | None = _SALT_QUERY) -> dict:
        if not store.delete(response_id, request_namespace(request, _salt(cache_salt))):
            raise _not_found()
        return {"id": response_id, "object": "response.deleted", "deleted": True}
