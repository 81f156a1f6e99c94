"""The periodic log line: what the engine is doing now, and what the prefix cache is really worth.

Every `interval` seconds while the engine is busy, one INFO line on the `brine.metrics` logger:

    Avg prompt throughput: 812.4 tokens/s, Avg generation throughput: 21.0 tokens/s, Running: 2 reqs,
    Waiting: 0 reqs, KV cache usage: 7.8%, Prefix cache hit rate: 49.6% (1984/4000 tokens, last 3 requests)

With speculative decoding, a window that verified drafts adds its draft acceptance rate and mean acceptance
length (tokens per verified draft, the model's own next token included), as vLLM's SpecDecoding line does:

    ..., Spec decode acceptance rate: 71.2% (299/420 draft tokens), mean acceptance length 3.42, draft threshold 0.063

The threshold is the least chance of acceptance a draft token needed in the window's last drafting step: the
configured `min_draft_acceptance`, or, "auto", what a draft row measured to cost (engine.spec_cost).

The hit rate is over the last `window_requests` requests (not since start: an old warm-up would hide a cache
that stopped paying), and shows the token counts behind it, or "n/a" before any lookup, never a made-up 0%.
Prompt throughput counts tokens the model computed; cache hits are not computed and do not inflate it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from metrics.stats import IterationStats, SchedulerStats, SpecDecodingStats, StatLogger

logger = logging.getLogger("brine.metrics")


@dataclass(slots=True)
class _Lookup:
    requests: int
    queries: int
    hits: int


class CacheHitWindow:
    """Prefix-cache queries and hits summed over the most recent `max_requests` requests."""

    def __init__(self, max_requests: int = 1000) -> None:
        if max_requests < 1:
            raise ValueError("max_requests must be >= 1")
        self.max_requests = max_requests
        self._items: deque[_Lookup] = deque()
        self.requests = self.queries = self.hits = 0

    def observe(self, requests: int, queries: int, hits: int) -> None:
        if requests == 0 and queries == 0:
            return
        self._items.append(_Lookup(requests, queries, hits))
        self.requests += requests
        self.queries += queries
        self.hits += hits
        # Drop whole steps from the old end; the newest step always stays, even if it alone exceeds the cap.
        while self.requests > self.max_requests and len(self._items) > 1:
            old = self._items.popleft()
            self.requests -= old.requests
            self.queries -= old.queries
            self.hits -= old.hits

    def clear(self) -> None:
        self._items.clear()
        self.requests = self.queries = self.hits = 0

    @property
    def hit_rate(self) -> float | None:
        return self.hits / self.queries if self.queries else None


class LoggingStatLogger(StatLogger):
    """A `StatLogger` that accumulates each step; a timer thread logs one line per `interval` while busy.

    The line comes from a timer, not from `record()`: the engine does not step while idle, and on a slow CPU one
    prefill step can outlast the interval, so step times say nothing about when a window ends. Throughput is
    the tokens recorded in the window over the window's length.
    """

    def __init__(
        self,
        interval: float = 10.0,
        window_requests: int = 1000,
        *,
        clock: Callable[[], float] = time.monotonic,
        log: logging.Logger | None = None,
        autostart: bool = True,
    ) -> None:
        self.interval = interval
        self.window = CacheHitWindow(window_requests)
        self._clock = clock
        self._log = log or logger
        self._lock = threading.Lock()
        self._window_start = clock()
        self._prompt_tokens = 0
        self._generation_tokens = 0
        self._spec = SpecDecodingStats()  # drafts verified in the current window
        self._last: SchedulerStats = SchedulerStats()
        self._last_line_idle = True  # so the idle time before the first request logs nothing
        # The timer starts with the first step (tests pass autostart=False and call tick()).
        self._autostart = autostart
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        with self._lock:
            s, it = scheduler_stats, iteration_stats
            self._prompt_tokens += it.num_prompt_tokens
            self._generation_tokens += it.num_generation_tokens
            if it.spec_decoding is not None:
                sd = it.spec_decoding
                self._spec.num_drafts += sd.num_drafts
                self._spec.num_draft_tokens += sd.num_draft_tokens
                self._spec.num_accepted_tokens += sd.num_accepted_tokens
                if sd.threshold is not None:  # the window's latest
                    self._spec.threshold = sd.threshold
            if s.prefix_cache_reset:
                self.window.clear()
            pc = s.prefix_cache
            self.window.observe(pc.requests or (1 if pc.queries else 0), pc.queries, pc.hits)
            self._last = s
            if self._autostart and self._thread is None:
                self._window_start = self._clock()  # idle time before the first step is not a window
                self._thread = threading.Thread(target=self._run, name="brine-log-stats", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(self.interval):
            self.tick()

    def close(self) -> None:
        """Stops the timer thread (a daemon: a process may also just exit)."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)

    def tick(self) -> None:
        """Ends the current window: logs its line if the engine was busy in it (and once after it goes idle)."""
        with self._lock:
            end = self._clock()
            busy = bool(
                self._prompt_tokens
                or self._generation_tokens
                or self._last.num_running
                or self._last.num_waiting
            )
            if busy or not self._last_line_idle:
                self._log.info("%s", self.format_line(end))
            self._last_line_idle = not busy
            self._prompt_tokens = self._generation_tokens = 0
            self._spec = SpecDecodingStats()
            self._window_start = end

    def format_line(self, end: float | None = None) -> str:
        """The line for the window that ends at `end` (default: now)."""
        elapsed = (self._clock() if end is None else end) - self._window_start

        def rate(tokens: int) -> str:
            return f"{tokens / elapsed:.1f} tokens/s" if elapsed > 0 else "n/a"

        w, s = self.window, self._last
        hit = w.hit_rate
        hit_text = (
            "n/a"
            if hit is None
            else f"{100 * hit:.1f}% ({w.hits}/{w.queries} tokens, last {w.requests} requests)"
        )
        sd = self._spec
        spec_text = (
            f", Spec decode acceptance rate: {100 * sd.num_accepted_tokens / sd.num_draft_tokens:.1f}% "
            f"({sd.num_accepted_tokens}/{sd.num_draft_tokens} draft tokens), mean acceptance length "
            f"{1 + sd.num_accepted_tokens / sd.num_drafts:.2f}"
            + (f", draft threshold {sd.threshold:.3f}" if sd.threshold is not None else "")
            if sd.num_draft_tokens
            else ""
        )
        return (
            f"Avg prompt throughput: {rate(self._prompt_tokens)}, "
            f"Avg generation throughput: {rate(self._generation_tokens)}, "
            f"Running: {s.num_running} reqs, Waiting: {s.num_waiting} reqs, "
            f"KV cache usage: {100 * s.kv_cache_usage:.1f}%, "
            f"Prefix cache hit rate: {hit_text}{spec_text}"
        )
