"""What happened in one engine step, as plain records.

The engine fills a `SchedulerStats` and an `IterationStats` once per step and hands both to every stat logger
(`StatLogger.record`). These records are the only thing that crosses from the engine to `metrics/`: the
loggers never look at engine objects, so this package imports the stdlib and prometheus-client only.

Units: token counts are tokens, times are seconds (floats from a monotonic clock), KV usage is a fraction 0..1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol


@dataclass(slots=True)
class SchedulerStats:
    """The scheduler's state after one step, plus what its cache lookups found during that step."""

    num_running: int = 0
    num_waiting: int = 0
    kv_cache_usage: float = 0.0  # fraction of KV blocks with a reference (0..1)
    num_cached_blocks: int = 0  # blocks currently holding a prefix hash (reusable, in use or free)
    # Prefix-cache lookups made this step, in tokens. A request is looked up once, when it is first
    # scheduled; a request resumed after preemption is looked up again, into the preempted counters, so that
    # its own earlier blocks do not inflate the hit rate.
    prefix_cache_queries: int = 0
    prefix_cache_hits: int = 0
    prefix_cache_preempted_queries: int = 0
    prefix_cache_preempted_hits: int = 0
    # Number of requests behind prefix_cache_queries (kv_cache's PrefixCacheStats.requests). Added beyond the
    # contract so the log line can give the hit rate over the last N *requests*; when the engine leaves it at
    # 0, a step with queries counts as one request.
    prefix_cache_requests: int = 0
    num_preemptions: int = 0  # this step
    num_evictions: int = 0  # cached blocks whose hash was dropped on reallocation, this step


@dataclass(slots=True)
class FinishedRequestStats:
    """One request that finished (any reason) during the step."""

    finish_reason: str  # "stop" | "length" | "abort" | "error" (engine.outputs.FinishReason values)
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache at first scheduling
    e2e_latency: float  # arrival -> finish
    queue_time: float  # arrival -> first scheduled
    ttft: float  # arrival -> first token
    mean_time_per_output_token: float  # (finish - first token) / (generation tokens - 1); 0 for one token


@dataclass(slots=True)
class IterationStats:
    """Work done in one step."""

    num_prompt_tokens: int = 0  # prompt tokens computed this step (cache hits are not computed, not counted)
    num_generation_tokens: int = 0  # tokens sampled this step
    ttfts: list[float] = field(default_factory=list)  # one per request that got its first token this step
    inter_token_latencies: list[float] = field(default_factory=list)  # one per later token this step
    finished: list[FinishedRequestStats] = field(default_factory=list)


class StatLogger(Protocol):
    """Called by the engine once per step, from its step thread."""

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...
