"""The skeleton both generation routes share: the checks before tokenizing, one `Prepared` request, and a
`Generation` accumulator whose `respond` starts the stream and then streams or collects.

`serving_chat.ChatGeneration` and `serving_completion.CompletionGeneration` keep only what differs: how a
sequence delta folds into a choice, the chunks one delta becomes, and the final body. Messages and Responses
(`serving_messages`, `serving_responses`) answer through the same `respond`, framing their own events (`sse`). The order of a
request's life is fixed here: `start` (the engine refuses what can never run before any byte is sent),
then either SSE chunks (`opening`, per-delta `deltas`, the `include_usage` tail, `[DONE]`) or one JSON body.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.responses import Response

from engine.outputs import CompletionOutput, FinishReason, RequestOutput
from engine.sampling_params import SamplingParams
from kv_cache.namespace import CacheNamespace
from server.engine_client import EngineClient
from server.errors import SERVER_ERROR, APIError
from server.generation import (
    EngineStreamingResponse,
    OutputStream,
    check_output,
    sse_chunks,
    unless_disconnected,
)
from server.limits import check_limits
from server.lora_routes import select_adapter, with_adapter
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.responses import TokenTexts, finish_reason, new_id, now, usage
from server.structured import start_constrained
from server.tenancy import request_namespace
from server.text_check import check_text


def check_generation(
    engine: EngineClient,
    req: ChatCompletionRequest | CompletionRequest,
    request: Request,
    check_features: Callable[[Any], None],
) -> CacheNamespace | None:
    """The checks every generation request passes before anything is tokenized, in order; its namespace."""
    check_text(req)  # first: a field that is not valid Unicode cannot even be named back in an error
    check_limits(req, request.app.state.limits)  # before anything is tokenized
    namespace = request_namespace(request, req.cache_salt)
    # The base model, or a LoRA adapter this caller may use (its typed cache key joins the namespace).
    namespace = with_adapter(namespace, select_adapter(engine, request, req.model))
    check_features(req)
    return namespace


@dataclass(slots=True)
class Prepared:
    """A checked generation request, ready for the engine (and for its `/render` twin)."""

    namespace: CacheNamespace | None
    prompts: list[list[int]]  # one per engine request: chat has one, completions one per prompt
    params: SamplingParams
    constraint: str | None  # the request field that carried an output constraint, if any


def final_reason(reason: FinishReason | None) -> str:
    """A choice's finish reason for the client. Our client is still here (else nobody would read this), so a
    sequence that ended without a reason or aborted was dropped by the engine itself: a 503."""
    if reason is None or reason == FinishReason.ABORT:
        raise APIError("The request was aborted by the engine.", status=503, type=SERVER_ERROR)
    if reason == FinishReason.ERROR:
        raise APIError("The engine failed while generating.", status=500, type=SERVER_ERROR)
    return finish_reason(reason) or "stop"


class Generation(ABC):
    """Per-request accumulator of one generation route, shared by its streaming and non-streaming paths."""

    chunk_object: ClassVar[str]  # the chunk's "object"
    id_prefix: ClassVar[str]

    def __init__(self, engine: EngineClient, prepared: Prepared) -> None:
        self.engine = engine
        self.prepared = prepared
        self.id = new_id(self.id_prefix)
        self.created = now()
        # An adapter's name where the request ran one (as vLLM answers), else the base model's.
        lora = prepared.namespace.lora if prepared.namespace is not None else None
        self.model = lora[0] if lora is not None else engine.model_name
        self.n = prepared.params.n
        self.texts = TokenTexts(engine.tokenizer)
        self.cached = [0] * len(prepared.prompts)  # per prompt: the most cached tokens any output reported
        self.num_tokens = 0  # generated, all choices together

    # ---- what each route defines ------------------------------------------------------------------------

    def opening(self) -> Iterable[dict[str, Any]]:
        """Chunks sent before any output (none by default)."""
        return ()

    @abstractmethod
    def deltas(self, prompt: int, out: RequestOutput, c: CompletionOutput) -> Iterable[dict[str, Any]]:
        """Streaming: the chunks one sequence delta becomes."""

    @abstractmethod
    def add(self, prompt: int, out: RequestOutput, c: CompletionOutput) -> None:
        """Collecting: fold one sequence delta into its choice."""

    @abstractmethod
    def body(self) -> dict[str, Any]:
        """Collecting: the whole response, once every sequence has finished."""

    # ---- the shared path ---------------------------------------------------------------------------------

    def chunk(self, choices: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": self.chunk_object,
            "created": self.created,
            "model": self.model,
            "choices": choices,
            **extra,
        }

    def usage(self) -> dict[str, Any]:
        return usage(sum(len(p) for p in self.prepared.prompts), self.num_tokens, sum(self.cached))

    async def respond(self, request: Request, streaming: bool, include_usage: bool = False) -> Response:
        """Every generation route's answer (chat, completions, Messages, Responses): start the engine stream
        (refusing what can never run before any byte is sent), then stream `sse` or collect one body."""
        prep = self.prepared
        stream = OutputStream(self.engine, prep.prompts, prep.params, self.id, prep.namespace)
        await start_constrained(request, stream, prep.constraint)
        if streaming:
            return EngineStreamingResponse(self.sse(stream, include_usage), stream)
        return JSONResponse(await unless_disconnected(request, self._collect(stream)))

    def sse(self, stream: OutputStream, include_usage: bool) -> AsyncIterator[str]:
        """The event stream's text, closing `stream` when it ends: OpenAI's `data:` chunks and `[DONE]` here;
        Messages and Responses frame their own events."""
        return sse_chunks(self._events(stream, include_usage), stream)

    def _outputs(self, prompt: int, out: RequestOutput) -> list[CompletionOutput]:
        check_output(out, self.prepared.constraint)
        self.cached[prompt] = max(self.cached[prompt], out.num_cached_tokens)
        self.num_tokens += sum(len(c.token_ids) for c in out.outputs)
        return out.outputs

    async def _collect(self, stream: OutputStream) -> dict[str, Any]:
        try:
            async for p, out in stream:
                for c in self._outputs(p, out):
                    self.add(p, out, c)
        finally:
            await stream.close()
        return self.body()

    async def _events(self, stream: OutputStream, include_usage: bool) -> AsyncIterator[dict[str, Any]]:
        for chunk in self.opening():
            yield chunk
        async for p, out in stream:
            for c in self._outputs(p, out):
                for chunk in self.deltas(p, out, c):
                    yield chunk
        if include_usage:
            yield self.chunk([], usage=self.usage())
