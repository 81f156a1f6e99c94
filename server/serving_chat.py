"""`POST /v1/chat/completions`: messages -> chat template -> engine -> a `chat.completion` object, or a stream
of `chat.completion.chunk` events (role chunk, content deltas, a finish chunk per choice, optional usage
chunk, `[DONE]`).

A forced tool call (`server.structured.ToolCallPlan`) is reported as `message.tool_calls` with finish reason
"tool_calls"; streamed, a named function's arguments go out as OpenAI's tool-call deltas as they are made
(id and name first), and a "required" call, whose function is known only once its name is complete, goes out
whole when the sequence ends. With `tool_choice: "auto"` on a model whose template has its own tool-call
format, the output is split into content and calls by `server.tool_parsers`, streamed as it is made.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from engine.outputs import CompletionOutput, FinishReason, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from kv_cache.namespace import CacheNamespace
from server.engine_client import EngineClient
from server.errors import SERVER_ERROR, APIError, bad_request
from server.generation import OutputStream, check_output, sse_response, unless_disconnected
from server.limits import check_limits
from server.params import check_chat_features, check_model, sampling_params
from server.prompts import render_chat
from server.protocol import ChatCompletionRequest
from server.responses import TokenTexts, chat_logprobs, finish_reason, new_id, now, usage
from server.structured import (
    ToolCallPlan,
    new_tool_call_id,
    start_constrained,
    structured_spec,
    tool_call_plan,
)
from server.tenancy import request_namespace
from server.text_check import check_text
from server.tool_parsers import HermesToolParser, parse_tool_calls, supports_hermes_tools


@dataclass(slots=True)
class _Choice:
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    logprobs: list[TokenLogprob] = field(default_factory=list)
    finish: FinishReason | None = None


@dataclass(slots=True)
class _Ctx:
    id: str
    created: int
    model: str
    want_logprobs: bool
    texts: TokenTexts
    num_prompt_tokens: int
    num_cached_tokens: int = 0
    tools: ToolCallPlan | None = None
    auto_tools: bool = False  # tool_choice "auto": calls are parsed out of the output

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


@dataclass(slots=True)
class PreparedChat:
    namespace: CacheNamespace | None
    prompt: list[int]
    params: SamplingParams
    constraint: str | None  # the request field that carried an output constraint, if any
    tools: ToolCallPlan | None  # a forced tool call
    auto_tools: bool = False  # tool_choice "auto" on a template with its own tool-call format


async def prepare_chat(engine: EngineClient, req: ChatCompletionRequest, request: Request) -> PreparedChat:
    """Every check of a chat request, in order, then its prompt and params: shared by the generating route
    and its `/render` twin, so a request one refuses the other refuses alike."""
    check_text(req)  # first: a field that is not valid Unicode cannot even be named back in an error
    check_limits(req, request.app.state.limits)  # before anything is tokenized
    namespace = request_namespace(request, req.cache_salt)
    check_model(req.model, engine.model_name)
    check_chat_features(req)
    auto_tools = (
        bool(req.tools) and req.tool_choice in (None, "auto") and supports_hermes_tools(engine.tokenizer)
    )
    tools = tool_call_plan(req, auto_tools)
    constraint = structured_spec(req)
    if tools is not None and constraint is not None:
        raise bad_request(
            f"{constraint[0]} cannot be combined with a forced tool call (tool_choice).", constraint[0]
        )
    if tools is not None:
        constraint = ("tools", tools.spec)
    # In a worker thread: tokenizing a long prompt takes long, and the event loop must keep serving streams.
    prompt = await run_in_threadpool(
        render_chat,
        engine.tokenizer,
        req.messages,
        add_generation_prompt=bool(req.add_generation_prompt),
        continue_final_message=bool(req.continue_final_message),
        chat_template_kwargs=req.chat_template_kwargs,
        tools=req.tools if req.tool_choice != "none" else None,
    )
    params = sampling_params(
        req,
        num_prompt_tokens=len(prompt),
        max_model_len=engine.max_model_len,
        vocab_size=engine.tokenizer.vocab_size,
        structured=constraint[1] if constraint else None,
    )
    return PreparedChat(namespace, prompt, params, constraint[0] if constraint else None, tools, auto_tools)


async def create_chat_completion(
    engine: EngineClient, req: ChatCompletionRequest, request: Request
) -> Response:
    """`req` comes validated from the route's typed body; `request` is watched for a disconnect."""
    prep = await prepare_chat(engine, req, request)
    prompt, params = prep.prompt, prep.params
    ctx = _Ctx(
        id=new_id("chatcmpl"),
        created=now(),
        model=engine.model_name,
        want_logprobs=params.logprobs is not None,
        texts=TokenTexts(engine.tokenizer),
        num_prompt_tokens=len(prompt),
        tools=prep.tools,
        auto_tools=prep.auto_tools,
    )
    stream = OutputStream(engine, [prompt], params, ctx.id, prep.namespace)
    await start_constrained(request, stream, prep.constraint)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        events = _stream(ctx, stream, params.n, include_usage)
        return sse_response(events, stream)
    return JSONResponse(await unless_disconnected(request, _collect(ctx, stream, params.n)))


def _absorb(ctx: _Ctx, out: RequestOutput) -> None:
    check_output(out)
    ctx.num_cached_tokens = max(ctx.num_cached_tokens, out.num_cached_tokens)


def _final_reason(reason: FinishReason) -> str:
    if reason == FinishReason.ABORT:
        # Our client is still here (else nobody would read this): the engine dropped the request itself.
        raise APIError("The request was aborted by the engine.", status=503, type=SERVER_ERROR)
    if reason == FinishReason.ERROR:
        raise APIError("The engine failed while generating.", status=500, type=SERVER_ERROR)
    return finish_reason(reason) or "stop"


async def _collect(ctx: _Ctx, stream: OutputStream, n: int) -> dict[str, Any]:
    choices = [_Choice() for _ in range(n)]
    try:
        async for _, out in stream:
            _absorb(ctx, out)
            for c in out.outputs:
                choice = choices[c.index]
                choice.text.append(c.text)
                choice.num_tokens += len(c.token_ids)
                choice.logprobs.extend(c.logprobs or ())
                choice.finish = c.finish_reason or choice.finish
    finally:
        await stream.close()
    body = []
    for i, choice in enumerate(choices):
        logprobs = None
        if ctx.want_logprobs:
            logprobs = {"content": chat_logprobs(choice.logprobs, ctx.texts), "refusal": None}
        reason = _final_reason(choice.finish or FinishReason.ABORT)
        message: dict[str, Any] = {"role": "assistant", "content": "".join(choice.text), "refusal": None}
        call = _tool_call(ctx, "".join(choice.text), reason)
        if call is not None:
            message["content"], message["tool_calls"] = None, [call]
            reason = "tool_calls" if reason == "stop" else reason
        elif ctx.auto_tools:
            message["content"], calls = parse_tool_calls(message["content"])
            if calls:
                message["tool_calls"] = calls
                reason = "tool_calls" if reason == "stop" else reason
        body.append({"index": i, "message": message, "logprobs": logprobs, "finish_reason": reason})
    return {
        "id": ctx.id,
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": body,
        "usage": usage(ctx.num_prompt_tokens, sum(c.num_tokens for c in choices), ctx.num_cached_tokens),
    }


def _tool_call(ctx: _Ctx, text: str, reason: str) -> dict[str, Any] | None:
    """The tool call a finished forced-call sequence made. A named call cut short (max_tokens) is still that
    call, with its partial arguments, as the stream already sent them; a "required" call cut short has no
    known function, so it is None (the text is content)."""
    if ctx.tools is None:
        return None
    parsed = ctx.tools.parse(text) if reason == "stop" else None
    if parsed is None and ctx.tools.name is not None and text:
        parsed = (ctx.tools.name, text)
    if parsed is None:
        return None
    name, arguments = parsed
    return {"id": new_tool_call_id(), "type": "function", "function": {"name": name, "arguments": arguments}}


def _tool_deltas(
    ctx: _Ctx, c: CompletionOutput, text: str, call_ids: list[str | None]
) -> list[tuple[dict[str, Any], str | None]]:
    """(delta, finish_reason) chunks for one output of a forced-call sequence; `text` is all of it so far."""
    assert ctx.tools is not None
    out: list[tuple[dict[str, Any], str | None]] = []
    named = ctx.tools.name
    if named is not None and c.text:
        if call_ids[c.index] is None:
            call_ids[c.index] = new_tool_call_id()
            head = {"index": 0, "id": call_ids[c.index], "type": "function"}
            out.append(({"tool_calls": [{**head, "function": {"name": named, "arguments": c.text}}]}, None))
        else:
            out.append(({"tool_calls": [{"index": 0, "function": {"arguments": c.text}}]}, None))
    if c.finish_reason is None:
        return out
    reason = _final_reason(c.finish_reason)
    if named is not None:
        return [*out, ({}, "tool_calls" if reason == "stop" and call_ids[c.index] else reason)]
    call = _tool_call(ctx, text, reason)
    if call is None:  # a "required" call cut short: what it made is plain content
        return [({"content": text}, None), ({}, reason)] if text else [({}, reason)]
    return [({"tool_calls": [{"index": 0, **call}]}, None), ({}, "tool_calls")]


def _parsed_chunks(ctx: _Ctx, parser: HermesToolParser, c: CompletionOutput) -> list[dict[str, Any]]:
    """The chunks for one output of a tool_choice "auto" sequence: the parser's content and tool-call deltas
    (the first carries the output's logprobs), then the finish."""
    deltas, reason = parser.step(c.text, _final_reason(c.finish_reason) if c.finish_reason else None)
    logprobs = None
    if ctx.want_logprobs and c.logprobs:
        logprobs = {"content": chat_logprobs(c.logprobs, ctx.texts), "refusal": None}
        deltas = deltas or [{"content": ""}]  # text held back by the parser still has its logprobs sent
    chunks = [
        ctx.chunk(
            [{"index": c.index, "delta": d, "logprobs": logprobs if i == 0 else None, "finish_reason": None}]
        )
        for i, d in enumerate(deltas)
    ]
    if reason is not None:
        chunks.append(ctx.chunk([{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": reason}]))
    return chunks


async def _stream(
    ctx: _Ctx, stream: OutputStream, n: int, include_usage: bool
) -> AsyncIterator[dict[str, Any]]:
    # The role comes first, in a chunk of its own per choice, as OpenAI sends it.
    for i in range(n):
        delta = {"role": "assistant", "content": ""}
        yield ctx.chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
    num_tokens = 0
    texts: list[list[str]] = [[] for _ in range(n)]
    call_ids: list[str | None] = [None] * n
    parsers = [HermesToolParser() for _ in range(n)] if ctx.auto_tools else None
    async for _, out in stream:
        _absorb(ctx, out)
        for c in out.outputs:
            num_tokens += len(c.token_ids)
            if ctx.tools is not None:
                texts[c.index].append(c.text)
                for delta, reason in _tool_deltas(ctx, c, "".join(texts[c.index]), call_ids):
                    yield ctx.chunk(
                        [{"index": c.index, "delta": delta, "logprobs": None, "finish_reason": reason}]
                    )
                continue
            if parsers is not None:
                for chunk in _parsed_chunks(ctx, parsers[c.index], c):
                    yield chunk
                continue
            if c.text or (ctx.want_logprobs and c.logprobs):
                logprobs = None
                if ctx.want_logprobs:
                    logprobs = {"content": chat_logprobs(c.logprobs or [], ctx.texts), "refusal": None}
                choice = {
                    "index": c.index,
                    "delta": {"content": c.text},
                    "logprobs": logprobs,
                    "finish_reason": None,
                }
                yield ctx.chunk([choice])
            if c.finish_reason is not None:
                reason = _final_reason(c.finish_reason)
                yield ctx.chunk([{"index": c.index, "delta": {}, "logprobs": None, "finish_reason": reason}])
    if include_usage:
        yield ctx.chunk([], usage=usage(ctx.num_prompt_tokens, num_tokens, ctx.num_cached_tokens))
