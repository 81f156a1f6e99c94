"""Worker processes that try each grammar compile first: under a timeout, under a memory limit, and killed
when the request that asked for it is gone.

Why processes: xgrammar's compile is one C++ call that cannot be interrupted, and some specs take long (a
20,000-value enum: 2.3 s and 105 MB on a 2-core EPYC; ten times that fits in a 16 MiB body). A thread could
only stop waiting: the compile would go on holding a worker of the pool, and a few such requests would stall
every tenant's structured outputs. A process can be killed. Why only a trial: a compiled grammar cannot be
handed back cheaply (`CompiledGrammar.serialize_json` of a 9 MB grammar took more than 24 GB), so the worker
reports how long the compile took, how big the grammar is and what its first mask costs, and the server
compiles it again in process, which then takes about as long as the trial did, within the timeout. That
doubles the CPU of a cache miss (typical schemas: 1-15 ms each), which buys a bound on every compile.

Rules a caller keeps: `trial()` blocks (call it from the compile pool, never the event loop or the step
thread); at most `workers` trials run at once and the others wait for a worker, and the timeout counts from
when the worker starts compiling, so a request never pays for another's slow schema with its own 400. A
worker that timed out, was cancelled or died is replaced by a fresh one (~2 s to start: xgrammar imports
torch).

Imports engine.grammar_compile (the compile steps it shares with the server's compiler) and
engine.structured_spec; engine.structured_output imports this module, never the other way.
"""

from __future__ import annotations

import logging
import os
import queue
import threading
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection
from typing import Any

from engine.grammar_compile import check_mask_cost, compile_failure, compile_spec
from engine.structured_spec import StructuredOutputError, StructuredOutputSpec
from engine.worker_process import WorkerProcess

logger = logging.getLogger(__name__)

COMPILE_TIMEOUT_S = 10.0
WORKERS = 2
_POLL_S = 0.05  # how often a waiting trial looks at its cancel event


class CompileCancelled(Exception):
    """The request whose grammar was compiling went away; its trial was killed."""


@dataclass(slots=True)
class Trial:
    seconds: float  # wall time of the compile in the worker
    memory_bytes: int  # xgrammar's memory_size_bytes of the result
    first_mask_s: float  # CPU time of the first token's mask


class _Worker:
    """One worker process (engine.worker_process: started with `python -c`, spoken to over a socket pair, dead
    with the server)."""

    def __init__(self, info_json: str, memory_limit: int, budget_s: float) -> None:
        # Killed by the kernel when the server ends, even mid-compile (engine.worker_process).
        self.process = WorkerProcess("engine.grammar_sandbox", "worker_main")
        self.proc, self.conn = self.process.proc, self.process.conn
        self.conn.send((info_json, memory_limit, budget_s))
        self.ready = False

    def wait_ready(self, cancel: threading.Event | None) -> None:
        if not self.ready:
            while not self.conn.poll(_POLL_S):
                if cancel is not None and cancel.is_set():
                    raise CompileCancelled()
            msg = self.conn.recv()  # EOFError if it died while starting
            if msg != ("ready",):
                raise RuntimeError(f"grammar worker failed to start: {msg!r}")
            self.ready = True

    def kill(self) -> None:
        self.process.kill()


class CompileSandbox:
    def __init__(
        self,
        tokenizer_info: Any,
        *,
        workers: int = WORKERS,
        timeout_s: float = COMPILE_TIMEOUT_S,
        memory_limit: int = 4 * 2**30,
        mask_budget_s: float = float("inf"),
    ) -> None:
        """`tokenizer_info`: the server's `xgrammar.TokenizerInfo`. `memory_limit`: bytes of data a worker may
        allocate (a compile past it fails as the client's error). Workers start on first need."""
        if workers < 1:
            raise ValueError(f"workers must be at least 1, got {workers}")
        self.timeout_s = timeout_s
        self.mask_budget_s = mask_budget_s
        self._info_json = tokenizer_info.serialize_json()
        self._memory_limit = memory_limit
        self.workers = workers
        self._idle: queue.Queue[_Worker] = queue.Queue()
        self._closed = False
        self._all: set[_Worker] = set()  # started and not killed: at most `workers`
        self._lock = threading.Lock()
        self.kills = 0  # workers killed (timeouts, cancellations, deaths): for tests

    @property
    def started(self) -> int:
        """Workers started (booting or ready) and not killed."""
        with self._lock:
            return len(self._all)

    def _spawn(self) -> _Worker | None:
        """A new worker if fewer than `workers` are alive (started on first need: a server that never sees a
        constraint never pays for one)."""
        with self._lock:
            if self._closed or len(self._all) >= self.workers:
                return None
            worker = _Worker(self._info_json, self._memory_limit, self.mask_budget_s)
            self._all.add(worker)
        return worker

    def trial(self, spec: StructuredOutputSpec, cancel: threading.Event | None = None) -> Trial:
        """Compiles `spec` in a worker. StructuredOutputError: it does not compile, takes longer than the
        timeout, dies (out of memory), or its first mask is over the budget. CompileCancelled: `cancel` was set
        before it finished (the worker is killed)."""
        worker = self._take(cancel)
        healthy = False
        try:
            worker.wait_ready(cancel)  # a fresh worker's start-up is not the spec's time
            worker.conn.send((spec.kind, spec.spec))
            deadline = time.monotonic() + self.timeout_s
            while not worker.conn.poll(min(_POLL_S, max(0.0, deadline - time.monotonic()))):
                if cancel is not None and cancel.is_set():
                    raise CompileCancelled()
                if time.monotonic() >= deadline:
                    raise StructuredOutputError(
                        f"The output constraint took longer than {self.timeout_s:g} s to compile "
                        "(--grammar-compile-timeout)."
                    )
            try:
                msg = worker.conn.recv()
            except EOFError:
                raise StructuredOutputError(
                    "The output constraint could not be compiled: the compiler ran out of memory."
                ) from None
            healthy = True
        finally:
            self._give_back(worker, healthy)
        if msg[0] == "error":
            raise StructuredOutputError(msg[1], msg[2])
        _, seconds, memory_bytes, first_mask_s = msg
        return Trial(seconds, memory_bytes, first_mask_s)

    def _take(self, cancel: threading.Event | None) -> _Worker:
        while True:
            if self._closed:
                raise RuntimeError("the grammar sandbox is closed")
            try:
                return self._idle.get_nowait()
            except queue.Empty:
                pass
            worker = self._spawn()
            if worker is not None:
                return worker
            try:
                return self._idle.get(timeout=_POLL_S)
            except queue.Empty:
                if cancel is not None and cancel.is_set():
                    raise CompileCancelled() from None

    def _give_back(self, worker: _Worker, healthy: bool) -> None:
        if healthy:
            self._idle.put(worker)
            return
        self.kills += 1
        worker.kill()
        with self._lock:
            self._all.discard(worker)
        self.prestart()  # its replacement boots now, not when the next request needs it

    def prestart(self) -> None:
        """Starts every worker not yet running (they boot in the background; ~2 s each)."""
        while (worker := self._spawn()) is not None:
            self._idle.put(worker)

    def close(self) -> None:
        self._closed = True
        with self._lock:
            workers, self._all = list(self._all), set()
        for worker in workers:
            worker.kill()


def worker_main(fd: int) -> None:
    """A worker process: compile each (kind, spec) it is sent, answer with what it cost. Runs until killed
    (or its parent goes: the socket closes)."""
    import resource

    # The tokenizer's info first, then the imports: the server's send of it (~1 MB, more than a socket
    # buffer holds) blocks until it is read here, and xgrammar's import (torch) takes ~2 s; read after it,
    # that held the server's start 2.5 s per worker (prestart) and a compile thread as long per replacement.
    conn = Connection(fd)
    info_json, memory_limit, budget_s = conn.recv()
    import xgrammar as xgr

    # After the imports (torch maps much at import): from here on a runaway compile fails, not the machine.
    _, hard = resource.getrlimit(resource.RLIMIT_DATA)
    limit = memory_limit if hard == resource.RLIM_INFINITY else min(memory_limit, hard)
    resource.setrlimit(resource.RLIMIT_DATA, (limit, hard))
    info = xgr.TokenizerInfo.deserialize_json(info_json)
    compiler = xgr.GrammarCompiler(info, max_threads=1, cache_enabled=False)
    conn.send(("ready",))
    while True:
        try:
            kind, text = conn.recv()
        except EOFError:  # the server closed the socket (the kernel kills a worker whose server died)
            os._exit(0)  # at once: a normal exit would tear torch down first
        spec = StructuredOutputSpec(kind, text)
        start = time.perf_counter()
        try:
            compiled = compile_spec(compiler, spec)
            seconds = time.perf_counter() - start
            first_mask_s = check_mask_cost(spec, compiled, info.vocab_size, budget_s)
            conn.send(("ok", seconds, compiled.memory_size_bytes, first_mask_s))
            compiled = None  # free it before waiting for the next spec
        except StructuredOutputError as exc:
            conn.send(("error", str(exc), exc.param))
        except Exception as exc:  # xgrammar's reason for refusing the spec (MemoryError past the limit too)
            err = compile_failure(spec, exc)
            conn.send(("error", str(err), err.param))
