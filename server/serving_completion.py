"""`POST /v1/completions`: one engine request per prompt (string, strings, token ids, lists of token ids),
`n` choices each; choice index = prompt_index * n + sequence index, as OpenAI numbers them.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from engine.outputs import CompletionOutput, FinishReason, RequestOutput
from engine.sampling_params import SamplingParams
from kv_cache.namespace import CacheNamespace
from server.engine_client import EngineClient
from server.errors import SERVER_ERROR, APIError
from server.generation import OutputStream, check_output, sse_response, unless_disconnected
from server.limits import check_limits
from server.params import check_completion_features, check_model, sampling_params
from server.prompts import completion_prompts
from server.protocol import CompletionRequest
from server.responses import CompletionLogprobs, TokenTexts, finish_reason, new_id, now, usage
from server.structured import start_constrained, structured_spec
from server.tenancy import request_namespace
from server.text_check import check_text


@dataclass(slots=True)
class _Choice:
    logprobs: CompletionLogprobs | None
    text: list[str] = field(default_factory=list)
    num_tokens: int = 0
    # Only filled when logprobs were asked for: tokens, token_logprobs, top_logprobs, text_offset.
    lp: dict[str, list[Any]] = field(
        default_factory=lambda: {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    )
    finish: FinishReason | None = None
    started: bool = False


class _Completion:
    """Per-request state shared by the streaming and non-streaming paths."""

    def __init__(
        self, engine: EngineClient, req: CompletionRequest, prompts: list[list[int]], n: int
    ) -> None:
        self.id = new_id("cmpl")
        self.created = now()
        self.model = engine.model_name
        self.n = n
        self.prompts = prompts
        self.echo = bool(req.echo)
        self.texts = TokenTexts(engine.tokenizer)
        want = req.logprobs is not None
        self.choices = [
            _Choice(CompletionLogprobs(self.texts) if want else None) for _ in range(len(prompts) * n)
        ]
        # Echo the prompt as the client sent it when it was text; decode it when it was token ids.
        raw = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        self.echo_texts = (
            [
                p if isinstance(p, str) else engine.tokenizer.decode(ids)
                for p, ids in zip(raw or [], prompts, strict=False)
            ]
            if self.echo
            else []
        )
        self.cached = [0] * len(prompts)
        self.num_tokens = 0

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "text_completion",
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def absorb(
        self, p: int, out: RequestOutput, c: CompletionOutput
    ) -> tuple[int, str, dict[str, Any] | None]:
        """Fold one sequence delta into its choice; returns (choice index, new text, new logprobs)."""
        index = p * self.n + c.index
        choice = self.choices[index]
        text, lp = c.text, None
        if choice.logprobs is not None:
            parts = []
            if not choice.started and self.echo and out.prompt_logprobs is not None:
                parts.append(choice.logprobs.build(list(out.prompt_logprobs), self.prompts[p]))
                # Generated tokens' offsets continue from the end of the echoed text itself.
                choice.logprobs.offset = len(self.echo_texts[p])
            if c.token_ids:
                parts.append(choice.logprobs.build(list(c.logprobs or []), list(c.token_ids)))
            if parts:
                lp = {key: [v for part in parts for v in part[key]] for key in parts[0]}
        if not choice.started and self.echo:
            text = self.echo_texts[p] + text
        choice.started = True
        choice.text.append(text)
        choice.num_tokens += len(c.token_ids)
        self.num_tokens += len(c.token_ids)
        if lp is not None:
            for key, values in lp.items():
                choice.lp[key].extend(values)
        choice.finish = c.finish_reason or choice.finish
        return index, text, lp

    def usage(self) -> dict[str, Any]:
        return usage(sum(len(p) for p in self.prompts), self.num_tokens, sum(self.cached))


def _final_reason(reason: FinishReason | None) -> str:
    if reason is None or reason == FinishReason.ABORT:
        raise APIError("The request was aborted by the engine.", status=503, type=SERVER_ERROR)
    if reason == FinishReason.ERROR:
        raise APIError("The engine failed while generating.", status=500, type=SERVER_ERROR)
    return finish_reason(reason) or "stop"


@dataclass(slots=True)
class PreparedCompletion:
    namespace: CacheNamespace | None
    prompts: list[list[int]]
    params: SamplingParams
    constraint: str | None  # the request field that carried an output constraint, if any


async def prepare_completion(
    engine: EngineClient, req: CompletionRequest, request: Request
) -> PreparedCompletion:
    """Every check of a completion request, in order, then its prompts and params: shared by the generating
    route and its `/render` twin, so a request one refuses the other refuses alike."""
    check_text(req)  # first: a field that is not valid Unicode cannot even be named back in an error
    check_limits(req, request.app.state.limits)  # before anything is tokenized
    namespace = request_namespace(request, req.cache_salt)
    check_model(req.model, engine.model_name)
    check_completion_features(req)
    constraint = structured_spec(req)
    vocab = engine.tokenizer.vocab_size
    # In a worker thread: tokenizing a long prompt takes long, and the event loop must keep serving streams.
    prompts = await run_in_threadpool(completion_prompts, engine.tokenizer, req.prompt, vocab)
    # The longest prompt decides the context check; each prompt gets the same max_tokens.
    params = sampling_params(
        req,
        num_prompt_tokens=max(len(p) for p in prompts),
        max_model_len=engine.max_model_len,
        vocab_size=vocab,
        structured=constraint[1] if constraint else None,
    )
    return PreparedCompletion(namespace, prompts, params, constraint[0] if constraint else None)


async def create_completion(engine: EngineClient, req: CompletionRequest, request: Request) -> Response:
    """`req` comes validated from the route's typed body; `request` is watched for a disconnect."""
    prep = await prepare_completion(engine, req, request)
    prompts, params = prep.prompts, prep.params
    state = _Completion(engine, req, prompts, params.n)
    stream = OutputStream(engine, prompts, params, state.id, prep.namespace)
    await start_constrained(request, stream, prep.constraint)
    if req.stream:
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        return sse_response(_stream(state, stream, include_usage), stream)
    return JSONResponse(await unless_disconnected(request, _collect(state, stream)))


async def _collect(state: _Completion, stream: OutputStream) -> dict[str, Any]:
    try:
        async for p, out in stream:
            check_output(out)
            state.cached[p] = max(state.cached[p], out.num_cached_tokens)
            for c in out.outputs:
                state.absorb(p, out, c)
    finally:
        await stream.close()
    choices = [
        {
            "index": i,
            "text": "".join(choice.text),
            "logprobs": choice.lp if choice.logprobs is not None else None,
            "finish_reason": _final_reason(choice.finish),
        }
        for i, choice in enumerate(state.choices)
    ]
    return state.chunk(choices, usage=state.usage())


async def _stream(
    state: _Completion, stream: OutputStream, include_usage: bool
) -> AsyncIterator[dict[str, Any]]:
    async for p, out in stream:
        check_output(out)
        state.cached[p] = max(state.cached[p], out.num_cached_tokens)
        for c in out.outputs:
            index, text, lp = state.absorb(p, out, c)
            if text or lp:
                # finish_reason is null until the last chunk, as OpenAI streams it (the spec's shared
                # schema says otherwise; see tests/e2e for the SDK consequence).
                yield state.chunk([{"index": index, "text": text, "logprobs": lp, "finish_reason": None}])
            if c.finish_reason is not None:
                reason = _final_reason(c.finish_reason)
                yield state.chunk([{"index": index, "text": "", "logprobs": None, "finish_reason": reason}])
    if include_usage:
        yield state.chunk([], usage=state.usage())
