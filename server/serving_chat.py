"""`POST /v1/chat/completions`: messages -> chat template -> engine -> a `chat.completion` object, or a stream
of `chat.completion.chunk` events (role chunk, content deltas, a finish chunk per choice, optional usage
chunk, `[DONE]`).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from engine.outputs import FinishReason, RequestOutput, TokenLogprob
from engine.sampling_params import SamplingParams
from kv_cache.namespace import CacheNamespace
from server.engine_client import EngineClient, vocab_size
from server.errors import SERVER_ERROR, APIError
from server.generation import OutputStream, check_output, sse_response, unless_disconnected
from server.limits import check_limits
from server.params import check_chat_features, check_model, sampling_params
from server.prompts import render_chat
from server.protocol import ChatCompletionRequest
from server.responses import TokenTexts, chat_logprobs, finish_reason, new_id, now, usage
from server.tenancy import request_namespace
from server.text_check import check_text


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

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "chat.completion.chunk",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }


async def prepare_chat(
    engine: EngineClient, req: ChatCompletionRequest, request: Request
) -> tuple[CacheNamespace | None, list[int], SamplingParams]:
    """Every check of a chat request, in order, then its prompt and params: shared by the generating route
    and its `/render` twin, so a request one refuses the other refuses alike."""
    check_text(req)  # first: a field that is not valid Unicode cannot even be named back in an error
    check_limits(req, request.app.state.limits)  # before anything is tokenized
    namespace = request_namespace(request, req.cache_salt)
    check_model(req.model, engine.model_name)
    check_chat_features(req)
    # In a worker thread: tokenizing a long prompt takes long, and the event loop must keep serving streams.
    prompt = await run_in_threadpool(
        render_chat,
        engine.tokenizer,
        req.messages,
        add_generation_prompt=bool(req.add_generation_prompt),
        continue_final_message=bool(req.continue_final_message),
        chat_template_kwargs=req.chat_template_kwargs,
    )
    params = sampling_params(
        req,
        num_prompt_tokens=len(prompt),
        max_model_len=engine.max_model_len,
        vocab_size=vocab_size(engine.tokenizer),
    )
    return namespace, prompt, params


async def create_chat_completion(
    engine: EngineClient, req: ChatCompletionRequest, request: Request
) -> Response:
    """`req` comes validated from the route's typed body; `request` is watched for a disconnect."""
    namespace, prompt, params = await prepare_chat(engine, req, request)
    ctx = _Ctx(
        id=new_id("chatcmpl"),
        created=now(),
        model=engine.model_name,
        want_logprobs=params.logprobs is not None,
        texts=TokenTexts(engine.tokenizer),
        num_prompt_tokens=len(prompt),
    )
    stream = OutputStream(engine, [prompt], params, ctx.id, namespace)
    await unless_disconnected(request, stream.start())
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
        body.append(
            {
                "index": i,
                "message": {"role": "assistant", "content": "".join(choice.text), "refusal": None},
                "logprobs": logprobs,
                "finish_reason": _final_reason(choice.finish or FinishReason.ABORT),
            }
        )
    return {
        "id": ctx.id,
        "object": "chat.completion",
        "created": ctx.created,
        "model": ctx.model,
        "choices": body,
        "usage": usage(ctx.num_prompt_tokens, sum(c.num_tokens for c in choices), ctx.num_cached_tokens),
    }


async def _stream(
    ctx: _Ctx, stream: OutputStream, n: int, include_usage: bool
) -> AsyncIterator[dict[str, Any]]:
    # The role comes first, in a chunk of its own per choice, as OpenAI sends it.
    for i in range(n):
        delta = {"role": "assistant", "content": ""}
        yield ctx.chunk([{"index": i, "delta": delta, "logprobs": None, "finish_reason": None}])
    num_tokens = 0
    async for _, out in stream:
        _absorb(ctx, out)
        for c in out.outputs:
            num_tokens += len(c.token_ids)
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
