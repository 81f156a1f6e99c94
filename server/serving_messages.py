"""`POST /v1/messages` and `POST /v1/messages/count_tokens`: Anthropic's Messages API over the chat path.

A request is converted into the chat request it means (`server.messages_convert`) and prepared by chat's own
`prepare_chat`: the same checks, tenancy, limits, template, forced tool calls and sampling. The answer is a
`message` object, or Anthropic's stream: `message_start`, `ping`, per content block `content_block_start`,
`content_block_delta`s (`text_delta` / `input_json_delta`) and `content_block_stop`, then `message_delta`
(`stop_reason`, usage) and `message_stop`; an error after the stream started is an `error` event.

Tool use: `tool_choice` `tool` is chat's forced named call (its input streams as it is made), `any` is chat's
"required" call (whole at the end, when its tool is known), `auto` is the model's own tool-call format where
its template has one (`server.tool_parsers`). Stop reasons: `end_turn`, `max_tokens`, `stop_sequence` (with
the sequence), `tool_use`. Usage: `server.messages_cache`.
"""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from starlette.responses import Response

from engine.outputs import CompletionOutput, FinishReason, RequestOutput
from server.engine_client import EngineClient
from server.errors import APIError
from server.generation import OutputStream
from server.lora_routes import select_adapter
from server.messages_cache import breakpoint_tokens, cache_usage
from server.messages_convert import check_messages_limits, to_chat
from server.messages_errors import anthropic_error
from server.messages_protocol import CountTokensRequest, MessagesRequest
from server.messages_stream import Blocks
from server.prompts import off_loop, render_chat
from server.retention import CACHE_CONTROL_TTL_S
from server.serving import Generation, final_reason
from server.serving_chat import PreparedChat, prepare_chat
from server.text_check import check_text
from server.tool_parsers import HermesToolParser, supports_hermes_tools

logger = logging.getLogger("brine.server")


async def create_message(engine: EngineClient, req: MessagesRequest, request: Request) -> Response:
    check_text(req)  # first, naming this API's fields (the chat request is built from them)
    check_messages_limits(req, request.app.state.limits)
    auto_tools = bool(req.tools) and supports_hermes_tools(engine.tokenizer)
    converted = to_chat(req, auto_tools=auto_tools)
    prepared = await prepare_chat(engine, converted.chat, request)
    marked: int | None = None
    if converted.breakpoint is not None and engine.enable_prefix_caching:
        marked = await off_loop(
            breakpoint_tokens,
            engine.tokenizer,
            req,
            converted.breakpoint.item,
            prepared.prompts[0],
            auto_tools=auto_tools,
            namespace=prepared.namespace,
        )
    if converted.breakpoint is not None:  # honoured: the blocks up to the breakpoint stay for the TTL
        prepared.params.retention_s = CACHE_CONTROL_TTL_S[converted.breakpoint.ttl]
        prepared.params.retention_tokens = marked
    generation = MessagesGeneration(engine, prepared, marked)
    return await generation.respond(request, bool(req.stream), False)


async def count_message_tokens(engine: EngineClient, req: CountTokensRequest, request: Request) -> dict:
    """The prompt's tokens, as `/tokenize` counts a chat: no namespace needed, nothing generated."""
    check_text(req)
    select_adapter(engine, request, req.model)  # the base model or an adapter this caller may use, else 404
    chat = to_chat(req, auto_tools=True).chat
    tokens = await off_loop(
        render_chat,
        engine.tokenizer,
        chat.messages,
        add_generation_prompt=bool(chat.add_generation_prompt),
        continue_final_message=bool(chat.continue_final_message),
        chat_template_kwargs=None,
        tools=chat.tools if chat.tool_choice != "none" else None,
    )
    return {"input_tokens": len(tokens)}


def _frame(event: dict[str, Any]) -> str:
    data = json.dumps(event, ensure_ascii=False, separators=(",", ":"))
    return f"event: {event['type']}\ndata: {data}\n\n"


class MessagesGeneration(Generation):
    """One Messages request's output as content blocks, streamed or whole (the same steps either way)."""

    chunk_object = "message"
    id_prefix = "msg"

    def __init__(self, engine: EngineClient, prepared: PreparedChat, breakpoint: int | None) -> None:
        super().__init__(engine, prepared)
        self.id = f"msg_{uuid.uuid4().hex}"
        self.breakpoint = breakpoint
        self.tools = prepared.tools
        self.parser = HermesToolParser() if prepared.auto_tools else None
        self.blocks = Blocks()
        self.text: list[str] = []
        self.finish: FinishReason | None = None
        self.stop_reason: int | str | None = None

    # ---- the steps ---------------------------------------------------------------------------------------

    def step(self, c: CompletionOutput) -> list[dict[str, Any]]:
        """The block events of one output of the (single) sequence."""
        self.text.append(c.text)
        if c.finish_reason is not None:
            self.finish, self.stop_reason = c.finish_reason, c.stop_reason
        blocks = self.blocks
        events: list[dict[str, Any]] = []
        if self.parser is not None:
            reason = final_reason(c.finish_reason) if c.finish_reason is not None else None
            deltas, _ = self.parser.step(c.text, reason)
            for delta in deltas:
                events += blocks.chat_delta(delta)
        elif self.tools is not None and self.tools.name is not None:  # a named call: its input as it comes
            if c.text and not blocks.blocks:
                events += blocks.tool_use(self.tools.name)
            events += blocks.input_json(c.text)
        elif self.tools is not None:  # "any": which tool is known once the call is whole
            if c.finish_reason is not None:
                text = "".join(self.text)
                call = self.tools.parse(text) if final_reason(c.finish_reason) == "stop" else None
                if call is None:  # cut short: what it made is text
                    events += blocks.text(text, open_empty=True)
                else:
                    events += blocks.tool_use(call[0]) + blocks.input_json(call[1])
        else:
            events += blocks.text(c.text, open_empty=True)
        if c.finish_reason is not None:
            events += blocks.close()
        return events

    def stop(self) -> tuple[str, str | None]:
        """(stop_reason, stop_sequence) of the finished sequence."""
        reason = final_reason(self.finish)  # a 503 / 500 when the engine aborted or failed it
        if reason == "length":
            return "max_tokens", None
        if self.blocks.has_tool_use:
            return "tool_use", None
        if isinstance(self.stop_reason, str):
            return "stop_sequence", self.stop_reason
        return "end_turn", None

    def messages_usage(self) -> dict[str, int]:
        cache = cache_usage(
            len(self.prepared.prompts[0]),
            self.cached[0],
            self.breakpoint,
            block_size=self.engine.block_size,
            caching=self.engine.enable_prefix_caching,
        )
        return {
            "input_tokens": cache.input_tokens,
            "output_tokens": self.num_tokens,
            "cache_creation_input_tokens": cache.cache_creation_input_tokens,
            "cache_read_input_tokens": cache.cache_read_input_tokens,
        }

    def message(self, content: list[dict[str, Any]], stop: tuple[str | None, str | None]) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "message",
            "role": "assistant",
            "model": self.model,
            "content": content,
            "stop_reason": stop[0],
            "stop_sequence": stop[1],
            "usage": self.messages_usage(),
        }

    # ---- Generation's hooks -------------------------------------------------------------------------------

    def add(self, prompt: int, out: RequestOutput, c: CompletionOutput) -> None:
        self.step(c)

    def deltas(self, prompt: int, out: RequestOutput, c: CompletionOutput) -> list[dict[str, Any]]:
        return self.step(c)

    def body(self) -> dict[str, Any]:
        stop = self.stop()
        return self.message(self.blocks.whole(), stop)

    # ---- streaming (Generation.respond streams this) ---------------------------------------------------

    async def sse(self, stream: OutputStream, include_usage: bool) -> AsyncIterator[str]:
        """Anthropic's named events; an error once the stream started is an `error` event."""
        try:
            try:
                async for event in self._stream_events(stream):
                    yield _frame(event)
            except APIError as exc:
                yield _frame(anthropic_error(exc.status, exc.message))
            except Exception:
                logger.exception("error while streaming a response")
                yield _frame(anthropic_error(500, "internal server error"))
        finally:
            await stream.close()

    async def _stream_events(self, stream: OutputStream) -> AsyncIterator[dict[str, Any]]:
        started = False
        async for p, out in stream:
            outputs = self._outputs(p, out)  # the first one brings the cached-token count
            if not started:
                started = True
                yield {"type": "message_start", "message": self.message([], (None, None))}
                yield {"type": "ping"}
            for c in outputs:
                for event in self.step(c):
                    yield event
        stop_reason, stop_sequence = self.stop()
        usage = self.messages_usage()
        delta = {"stop_reason": stop_reason, "stop_sequence": stop_sequence}
        yield {"type": "message_delta", "delta": delta, "usage": usage}
        yield {"type": "message_stop"}
