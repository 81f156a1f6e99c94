"""Driving `engine.generate` for one HTTP request: start every prompt, merge their outputs, abort whatever is
unfinished when the client goes away, and frame server-sent events.

Rule kept here: every request started in the engine is either finished or aborted before the HTTP request
ends, whatever happens (client disconnect, error, cancellation), so no KV block stays held.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import suppress
from typing import TYPE_CHECKING, Any, TypeVar

import anyio
from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from engine.async_engine import EngineDeadError
from engine.errors import ContextLengthError, PromptTokenError
from engine.outputs import RequestOutput
from engine.request import Origin
from engine.sampling_params import SamplingParams
from engine.structured_spec import StructuredOutputError, is_mask_budget_error
from kv_cache.namespace import CacheNamespace
from server.engine_client import EngineClient
from server.errors import (
    SERVER_ERROR,
    APIError,
    bad_request,
    context_length_exceeded,
    engine_not_running,
    error_body,
)

if TYPE_CHECKING:
    from server.inflight import InflightLimiter

logger = logging.getLogger("brine.server")
T = TypeVar("T")
DONE = "data: [DONE]\n\n"
MASK_BUDGET_CODE = "grammar_mask_budget_exceeded"  # a request its own grammar's mask cost failed


def sse(obj: dict[str, Any]) -> str:
    return f"data: {json.dumps(obj, ensure_ascii=False, separators=(',', ':'))}\n\n"


def engine_error(exc: BaseException) -> APIError:
    """An exception from the engine as the error the client sees. The engine raises ValueError, before the
    first output, for requests that can never run: those are the client's to fix."""
    if isinstance(exc, EngineDeadError):
        return engine_not_running()
    if isinstance(exc, StructuredOutputError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, ContextLengthError):
        return context_length_exceeded(exc)
    if isinstance(exc, PromptTokenError):
        return bad_request(str(exc), exc.param)
    if isinstance(exc, ValueError):
        return bad_request(str(exc) or "invalid request")
    logger.error("engine failed while serving a request: %s", type(exc).__name__, exc_info=exc)
    return APIError("The engine failed while generating.", status=500, type=SERVER_ERROR)


def check_output(out: RequestOutput, constraint: str | None = None) -> None:
    """Raises for an output that carries the engine's error. A request failed by its own grammar (its masks
    over the per-token budget) is the client's to fix: a 400 that says so, naming `constraint` (the field that
    carried it); any other failure is a 500 that tells the client nothing of the engine's insides."""
    if out.error is None:
        return
    if is_mask_budget_error(out.error):
        raise bad_request(out.error, constraint or "response_format", code=MASK_BUDGET_CODE)
    logger.error("request %s failed in the engine: %s", out.request_id, out.error)
    raise APIError("The engine failed while generating.", status=500, type=SERVER_ERROR)


class OutputStream:
    """The engine requests of one HTTP request (one per prompt), merged into one stream of
    (prompt_index, RequestOutput). Call `start()` first, then iterate; `close()` always, in a finally."""

    def __init__(
        self,
        engine: EngineClient,
        prompts: list[list[int]],
        params: SamplingParams,
        request_id: str,
        namespace: CacheNamespace | None,
    ) -> None:
        self._engine = engine
        self.request_ids = (
            [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]
        )
        # One record to the engine: the namespace, and this API request as the group its prompts share one
        # fair share by (the engine shares by the namespace instead wherever there is one).
        origin = Origin(namespace, group=request_id)
        self._gens = [
            engine.generate(p, params, request_id=rid, origin=origin)
            for p, rid in zip(prompts, self.request_ids, strict=True)
        ]
        self._namespace = namespace
        self._release: Callable[[], None] | None = None  # the in-flight slot taken by start()
        self._finished = [False] * len(prompts)
        self._first: list[RequestOutput] = []
        self._tasks: list[asyncio.Task[Any]] = []
        self._closed = False

    async def start(self, limiter: InflightLimiter | None = None) -> list[RequestOutput]:
        """Wait for every prompt's first output, so that requests the engine refuses (context length, too
        big for the KV cache) fail before any HTTP response starts. Prompts are submitted concurrently.
        `limiter`: first take one of the namespace's in-flight slots (a 429 when it has none left); close()
        gives it back."""
        if limiter is not None:
            self._release = limiter.acquire(self._namespace, self)
        self._tasks = [asyncio.ensure_future(anext(gen)) for gen in self._gens]
        try:
            self._first = list(await asyncio.gather(*self._tasks))
        except BaseException as exc:
            await self.close()
            if isinstance(exc, StopAsyncIteration):
                raise APIError("The engine returned no output.", status=500, type=SERVER_ERROR) from None
            if isinstance(exc, Exception) and not isinstance(exc, APIError):
                raise engine_error(exc) from None
            raise
        finally:
            self._tasks = []
        for i, out in enumerate(self._first):
            self._finished[i] = out.finished
        return self._first

    async def __aiter__(self) -> AsyncIterator[tuple[int, RequestOutput]]:
        for i, out in enumerate(self._first):
            yield i, out
        queue: asyncio.Queue[tuple[int, RequestOutput | BaseException | None]] = asyncio.Queue()

        async def pump(i: int) -> None:
            try:
                async for out in self._gens[i]:
                    await queue.put((i, out))
            except Exception as exc:
                await queue.put((i, exc))
            finally:
                queue.put_nowait((i, None))

        self._tasks = [asyncio.ensure_future(pump(i)) for i, done in enumerate(self._finished) if not done]
        remaining = len(self._tasks)
        while remaining:
            i, item = await queue.get()
            if item is None:
                remaining -= 1
                self._finished[i] = True
            elif isinstance(item, BaseException):
                raise engine_error(item)
            else:
                self._finished[i] = self._finished[i] or item.finished
                yield i, item

    async def close(self) -> None:
        """Stop our consumers and abort every unfinished engine request. Shielded: this runs while the
        surrounding task is being cancelled (client disconnect), and an abort must still get through.
        Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            await self._stop()
        finally:
            if self._release is not None:
                self._release()

    async def _stop(self) -> None:
        with anyio.CancelScope(shield=True):
            for task in self._tasks:
                task.cancel()
            for task in self._tasks:
                with suppress(BaseException):
                    await task
            for gen in self._gens:
                with suppress(Exception):
                    await gen.aclose()
            for rid, finished in zip(self.request_ids, self._finished, strict=True):
                if not finished:
                    with suppress(Exception):
                        await self._engine.abort(rid)


class ClientDisconnected(Exception):
    pass


async def _wait_for_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def unless_disconnected(request: Request, work: Awaitable[T]) -> T:
    """Run `work`, cancelling it if the client disconnects first (then raise ClientDisconnected).

    Needed for non-streaming requests and for the wait before a stream's first byte: Starlette only watches
    for disconnects while a streaming response is being sent.
    """
    task = asyncio.ensure_future(work)
    watcher = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        watcher.cancel()
        if not task.done():
            task.cancel()
            with suppress(BaseException):
                await task
    if task.cancelled():
        raise ClientDisconnected()
    return task.result()


class EngineStreamingResponse(StreamingResponse):
    """An event stream over `stream` (every generation route's, `server.serving.Generation.respond`). Closes
    the engine stream even when the body iterator never started (a client that disconnects before the first
    byte): an un-started async generator never runs its `finally`."""

    def __init__(self, content: AsyncIterator[str], stream: OutputStream) -> None:
        super().__init__(content, media_type="text/event-stream")
        self._stream = stream

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self._stream.close()


async def sse_chunks(events: AsyncIterator[dict[str, Any]], stream: OutputStream) -> AsyncIterator[str]:
    """Frame `events` as SSE and end with `data: [DONE]`. An error after the stream started can no longer
    change the status code, so it becomes a `data: {"error": ...}` event before [DONE]."""
    try:
        try:
            async for obj in events:
                yield sse(obj)
        except APIError as exc:
            yield sse(exc.body())
        except Exception:
            logger.exception("error while streaming a response")
            yield sse(error_body("internal server error", type=SERVER_ERROR))
        yield DONE
    finally:
        await stream.close()
