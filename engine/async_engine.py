"""The asyncio face of the engine: `generate()` streams `RequestOutput` deltas; one background thread steps.

Threads: the step thread owns the `EngineCore` (scheduler, KV cache manager, runner); nothing else touches
them except under `_core_lock`, which the step thread holds for a whole step. Callers reach the thread through
a `queue.Queue` of commands (add / abort / stop); the thread hands outputs back with
`loop.call_soon_threadsafe` into one `asyncio.Queue` per request. The step thread routes outputs through its
own map of the streams it added, not the callers' registry by id: a caller may close its stream and reuse the
id at once, while the old request's last outputs are still on their way.

Failure rules: a request that fails inside the engine gets a final output with `error` set; an exception from
the runner kills the engine: `is_healthy()` turns False and every pending and later `generate()` raises
`EngineDeadError` instead of hanging.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import queue
import threading
import uuid
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.grammar_public import PublicGrammarError, load_public_specs
from engine.grammar_sandbox import CompileSandbox
from engine.outputs import RequestOutput
from engine.request import Origin
from engine.sampling_params import SamplingParams
from engine.structured_output import (
    CompiledGrammar,
    GrammarCompiler,
    StructuredOutputError,
    check_sequences,
    tokenizer_info,
)
from engine.threads import default_torch_threads, on_fresh_thread, set_torch_threads
from engine.tokenizer import Tokenizer
from kv_cache.namespace import CacheNamespace, Owner

if TYPE_CHECKING:  # zmq: imported only when KV events are on
    from engine.kv_event_publisher import KVEventPublisher

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine stopped (fatal error or shutdown); no request can be served any more."""


@dataclass(slots=True)
class _Stream:
    loop: asyncio.AbstractEventLoop
    queue: asyncio.Queue


@dataclass(slots=True)
class _Add:
    """Inbox command: put a request into the core (unless its caller has gone meanwhile)."""

    request_id: str
    stream: _Stream
    prompt_token_ids: list[int]
    params: SamplingParams
    origin: Origin | None
    grammar: CompiledGrammar | None


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _Stop:
    """Inbox command: leave the step loop (shutdown)."""


_Command = _Add | _Abort | _Stop


@dataclass(slots=True)
class _Pause:
    """The step thread's side of a pause in a step (engine.express.Interjection)."""

    poll: Callable[[], None]
    emit: Callable[[list[RequestOutput]], None]


class AsyncEngine:
    def __init__(
        self,
        core: EngineCore,
        tokenizer: Tokenizer,
        *,
        model_name: str,
        kv_events: KVEventPublisher | None = None,
        grammars: GrammarCompiler | None = None,
        threads: int | None = None,
    ) -> None:
        """kv_events: the `KVEventPublisher` fed by `core` (its sink), closed by `shutdown`; None if off.
        grammars: compiles structured-output constraints; None where the tokenizer cannot feed a grammar
        engine (such requests are refused with a 400). threads: torch's intra-op threads, set again on the
        step thread before its first step (None: leave torch's setting alone)."""
        if threads is not None and threads < 1:
            raise ValueError(f"threads must be at least 1, got {threads}")
        self._threads = threads
        self._core = core
        self.kv_events = kv_events
        self._grammars = grammars
        # Compiles get a pool of their own (never the default executor, which tokenizing shares), as many
        # threads as the compiler runs compiles at once: a slow schema holds back only other compiles.
        self._compile_pool = (
            ThreadPoolExecutor(grammars.workers, thread_name_prefix="brine-grammar-compile")
            if grammars is not None
            else None
        )
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.max_model_len = core.max_model_len
        self.vocab_size = (
            core.vocab_size
        )  # the ids a prompt may hold (the smaller of model's and tokenizer's)
        self.enable_prefix_caching = core.enable_prefix_caching
        self.num_blocks = core.num_blocks  # KV cache size, for the startup log
        self.block_size = core.block_size
        self.loras = core.loras  # thread-safe: the server lists, loads and unloads adapters through it
        self._inbox: queue.Queue[_Command] = queue.Queue()
        self._held: list[_Command] = []  # taken from the inbox during a step, applied after it (_poll_adds)
        self._pause = _Pause(self._poll_adds, self._dispatch)
        self._streams: dict[str, _Stream] = {}  # callers' registry: ids in use, streams to fail on death
        self._streams_lock = threading.Lock()
        self._live: dict[str, _Stream] = {}  # the step thread's own: requests in the core -> their stream
        self._core_lock = threading.Lock()
        self._dead: str | None = None  # why the engine stopped
        self._thread = threading.Thread(target=self._run, name="brine-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(cls, config: EngineConfig, *, prestart_grammar_workers: bool = False) -> AsyncEngine:
        """Loads the model and tokenizer and starts the step thread. `prestart_grammar_workers`: boot the
        grammar sandbox's workers now, in the background (`brine serve` does, so that its first constrained
        request does not wait ~2 s for one); else each boots when a constrained request first needs it, and an
        engine that never sees one never spends the ~2.5 s of CPU per worker (xgrammar imports torch)."""
        from engine.model.loading.files import resolve_model
        from engine.model_runner import ModelRunner  # torch: imported only when a real engine is made

        files = resolve_model(config.model)
        # Before the model loads: its batch-invariance probes must run with the threads that serve.
        set_torch_threads(config.threads)
        kv_events = None
        if config.kv_events_endpoint is not None:
            from engine.kv_event_publisher import KVEventPublisher, replay_endpoint_for

            endpoint = config.kv_events_endpoint
            kv_events = KVEventPublisher(endpoint, replay_endpoint_for(endpoint))
        config = dataclasses.replace(config, model=str(files.path))
        # Loaded on a thread of its own, which ends: the step thread is then the only one with an OpenMP pool.
        runner = on_fresh_thread(lambda: ModelRunner(config), config.threads)
        if config.max_model_len is not None and config.max_model_len > runner.max_model_len:
            raise ValueError(
                f"max_model_len {config.max_model_len} exceeds the model's context length {runner.max_model_len}"
            )
        tokenizer = Tokenizer(files.path)
        core = EngineCore(
            runner, tokenizer, config, kv_event_sink=kv_events.publish if kv_events is not None else None
        )
        logger.info(
            "engine ready: model %s (%s), %d KV blocks of %d tokens, prefix caching %s, %d torch threads%s",
            config.served_model_name or files.name,
            files.source,
            runner.num_blocks,
            runner.block_size,
            "on" if core.enable_prefix_caching else "off",
            default_torch_threads(),
            "" if config.threads is not None else " (torch's default; --threads sets it)",
        )
        stat_loggers = list(config.stat_loggers)

        def on_compile(seconds: float) -> None:
            for stat_logger in stat_loggers:
                stat_logger.observe_grammar_compile(seconds)

        grammars: GrammarCompiler | None = None
        try:
            info = tokenizer_info(tokenizer.hf, runner.vocab_size, tokenizer.eos_token_ids)
            budget_s = config.grammar_mask_budget_ms / 1e3
            sandbox = CompileSandbox(
                info,
                workers=config.grammar_compile_workers,
                timeout_s=config.grammar_compile_timeout,
                mask_budget_s=budget_s,
            )
            if prestart_grammar_workers:
                sandbox.prestart()
            grammars = GrammarCompiler(
                info,
                cache_bytes=config.grammar_cache_memory,
                mask_budget_s=budget_s,
                sandbox=sandbox,
                on_compile=on_compile,
            )
        except Exception:  # a tokenizer xgrammar cannot read: serve, but refuse structured outputs
            logger.exception("structured outputs disabled: the grammar engine cannot use this tokenizer")
        if config.public_grammar_dir is not None:  # the operator's: a file that fails stops the start
            if grammars is None:
                raise PublicGrammarError("--public-grammar-dir: this model's tokenizer has no grammar engine")
            grammars.add_public(load_public_specs(config.public_grammar_dir))
        return cls(
            core,
            tokenizer,
            model_name=config.served_model_name or files.name,
            kv_events=kv_events,
            grammars=grammars,
            threads=config.threads,
        )

    # ---- requests --------------------------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        origin: Origin | None = None,
    ) -> AsyncGenerator[RequestOutput, None]:
        """Yields deltas; the last has finished=True. ValueError before the first yield for a request that can
        never run. Closing or cancelling the iterator aborts the request (blocks freed at the next step).
        `origin` (`engine.request.Origin`): its cache namespace, whose cached blocks it may reuse (None: the
        shared unsalted one), and the API request it is part of, whose prompts share one fair share when they
        have no namespace; with one, the engine shares by the namespace (its tenant, gateway value or salt:
        `engine.request.fair_share_key`). Default: unsalted, this request alone."""
        self._core.check_request(prompt_token_ids, params)
        grammar = await self._compile(params, origin.namespace if origin is not None else None)
        request_id = request_id or uuid.uuid4().hex
        stream = _Stream(asyncio.get_running_loop(), asyncio.Queue())
        with self._streams_lock:
            if self._dead is not None:
                raise EngineDeadError(self._dead)
            if request_id in self._streams:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._streams[request_id] = stream
        self._inbox.put(_Add(request_id, stream, list(prompt_token_ids), params, origin, grammar))
        finished = False
        try:
            while not finished:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                finished = item.finished
                yield item
        finally:
            with self._streams_lock:
                self._streams.pop(request_id, None)
            if not finished:
                self._inbox.put(_Abort(request_id))

    async def _compile(
        self, params: SamplingParams, namespace: CacheNamespace | None
    ) -> CompiledGrammar | None:
        """The request's grammar, found in its namespace's cache or compiled on the compile pool, so that
        neither the step thread nor the event loop waits for a compilation. StructuredOutputError (a
        ValueError: the client's 400) if it cannot; a caller that goes away (cancelled) kills its compile."""
        spec = params.structured
        if spec is None:
            return None
        if self._grammars is None:
            raise StructuredOutputError("Structured outputs are not available for this model's tokenizer.")
        for stat_logger in self._core.stat_loggers:
            stat_logger.count_structured_output(spec.kind)
        hit = self._grammars.cached(spec, namespace)
        if hit is not None:
            return check_sequences(hit, params.n)  # n sequences spend one request's mask budget
        assert self._compile_pool is not None
        cancel = threading.Event()
        pending = asyncio.get_running_loop().run_in_executor(
            self._compile_pool, self._grammars.compile, spec, namespace, cancel
        )
        try:
            return check_sequences(await pending, params.n)
        except asyncio.CancelledError:
            cancel.set()  # queued: never starts; compiling: its worker process is killed
            raise

    async def abort(self, request_id: str) -> None:
        """Aborts a request; its generate() ends with finish_reason "abort"."""
        self._inbox.put(_Abort(request_id))

    def is_healthy(self) -> bool:
        return self._dead is None

    def reset_prefix_cache(self, force: bool = False) -> bool:
        """False while requests hold blocks, unless `force` (their blocks then lose their hashes and keep
        serving: an answer that does not depend on others' activity). Waits for the current step to end; on
        success the stat loggers see the emptied cache at once (the core records it under the lock, never
        during a step)."""
        with self._core_lock:
            done = self._core.reset_prefix_cache(force)
        if done:
            self.tokenizer.forget_pieces()  # nor may a prompt's tokenizing tell that it was sent before
            if self._grammars is not None:
                self._grammars.forget()  # nor a schema's compile
        return done

    def forget_prefix_cache(self, owner: Owner) -> int:
        """Forgets one tenant's cached private blocks (`CacheNamespace.owner`), even while requests run;
        returns how many. Public-prefix blocks and other tenants' blocks stay."""
        self.tokenizer.forget_pieces(owner)
        if self._grammars is not None:
            self._grammars.forget(owner)
        with self._core_lock:
            return self._core.forget_prefix_cache(owner)

    def set_public_prefixes(self, prefixes: list[list[int]]) -> None:
        """Declares the public prefixes (token ids) for every request added from now on."""
        with self._core_lock:
            self._core.set_public_prefixes(prefixes)

    def num_used_blocks(self) -> int:
        """KV blocks held now (`EngineCore.num_used_blocks`), read between steps: the leak checks' view."""
        with self._core_lock:
            return self._core.num_used_blocks()

    def tier_work_pending(self) -> bool:
        """Whether the KV tiers' threads still copy, encrypt or write blocks (False without tiers): what a
        benchmark waits for so that a tier's cost is charged to the run that caused it."""
        tiers = self._core.tiers
        return tiers is not None and (tiers.busy or tiers.writing)

    def kv_event_sources(self) -> dict[str, dict[str, Any]]:
        """`GET /kv_event_sources`: one entry per data-parallel rank, keyed by the rank as a string ({} when
        events are off)."""
        return {"0": self.kv_events.source()} if self.kv_events is not None else {}

    def shutdown(self) -> None:
        if self._thread.is_alive():
            self._inbox.put(_Stop())
            self._thread.join(timeout=30)
        self._fail_all("the engine was shut down")
        self._core.close()  # the KV tiers' last writes and the disk index
        if self._compile_pool is not None:
            self._compile_pool.shutdown(wait=False, cancel_futures=True)
        if self._grammars is not None:
            self._grammars.close()
        if self.kv_events is not None:
            self.kv_events.shutdown()

    # ---- the step thread -------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            set_torch_threads(self._threads)  # every op of every step runs on this thread
            while True:
                # Block only when idle; while busy, take whatever arrived since the last step.
                commands, self._held = self._held, []
                if not commands and not self._core.has_work():
                    commands.append(self._inbox.get())
                while True:
                    try:
                        commands.append(self._inbox.get_nowait())
                    except queue.Empty:
                        break
                if any(isinstance(cmd, _Stop) for cmd in commands):
                    return
                with self._core_lock:
                    for cmd in commands:  # in order: an abort's last output before a new request by its id
                        if not isinstance(cmd, _Stop):
                            self._dispatch(self._apply(cmd))
                    outputs = self._core.step(self._pause) if self._core.has_work() else []
                self._dispatch(outputs)
        except BaseException as exc:  # fatal: the runner (or the engine itself) broke
            logger.exception("engine step failed; the engine is dead")
            self._fail_all(f"engine error: {exc!r}")

    def _poll_adds(self) -> None:
        """At a pause in a step (engine.express): adds the requests that arrived since the step began, in
        order, up to the first other command: that one (an abort may free blocks the step in flight writes)
        and all after it wait for the step's end."""
        while not self._held:
            try:
                cmd = self._inbox.get_nowait()
            except queue.Empty:
                return
            if isinstance(cmd, _Add):
                self._dispatch(self._apply(cmd))
            else:
                self._held.append(cmd)

    def _apply(self, cmd: _Add | _Abort) -> list[RequestOutput]:
        if isinstance(cmd, _Abort):
            return self._core.abort_request(cmd.request_id)
        with self._streams_lock:
            if self._streams.get(cmd.request_id) is not cmd.stream:  # the caller went away before we saw it
                return []
        try:
            outputs = self._core.add_request(
                cmd.request_id,
                cmd.prompt_token_ids,
                cmd.params,
                origin=cmd.origin,
                grammar=cmd.grammar,
            )
        except Exception as exc:  # a bug in adding one request must not kill the engine
            logger.exception("could not add request %s", cmd.request_id)
            _push(cmd.stream, exc)
            return []
        self._live[cmd.request_id] = cmd.stream
        return outputs

    def _dispatch(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._live.pop(out.request_id, None) if out.finished else self._live.get(out.request_id)
            if stream is not None:
                _push(stream, out)

    def _fail_all(self, reason: str) -> None:
        with self._streams_lock:
            if self._dead is None:
                self._dead = reason
            streams = list(self._streams.values())
        for stream in streams:
            _push(stream, EngineDeadError(reason))


def _push(stream: _Stream, item: RequestOutput | BaseException) -> None:
    try:
        stream.loop.call_soon_threadsafe(stream.queue.put_nowait, item)
    except RuntimeError:  # the caller's event loop is closed: nobody is listening any more
        pass
