"""What happened in one engine step, as plain records.

The engine fills a `SchedulerStats` and an `IterationStats` once per step (and once after a prefix-cache
reset, with an empty `IterationStats`) and hands both to every stat logger (`StatLogger.record`). These
records are the only thing that crosses from the engine to `metrics/`: the loggers never look at engine
objects, so this package imports the stdlib, prometheus-client and kv_cache's torch-free records only. The
prefix cache's counters are kv_cache's own record (`kv_cache.stats.PrefixCacheStats`), carried whole in
`SchedulerStats.prefix_cache` from the KV cache manager to the loggers: a counter added there reaches every
logger without being listed again on the way.

Units: token counts are tokens, times are seconds (floats from a monotonic clock), KV usage is a fraction 0..1.

A plain counter or gauge is declared on its field (`kv_cache.stats.metric_field`) and `metrics.prometheus`
exports every declared field of these records and of `PrefixCacheStats` as it is: a new one is its field,
the line that fills it, and its row in docs/metrics.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

from kv_cache.stats import PrefixCacheStats, metric_field


@dataclass(slots=True)
class SchedulerStats:
    """The scheduler's state after one step (or a reset), plus what its cache lookups found since the last."""

    num_running: int = metric_field("gauge", "brine_num_requests_running", "Requests in the running batch.")
    num_waiting: int = metric_field(
        "gauge", "brine_num_requests_waiting", "Requests waiting to be scheduled."
    )
    # Fraction of KV blocks with a reference (0..1).
    kv_cache_usage: float = metric_field(
        "gauge", "brine_kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", default=0.0
    )
    # Blocks currently holding a prefix hash (reusable, in use or free).
    num_cached_blocks: int = metric_field(
        "gauge", "brine_num_cached_blocks", "KV blocks holding a prefix hash (reusable by a later request)."
    )
    # What the prefix cache did since the last record (lookups, hits, evictions, retention), as the KV cache
    # manager counted it (`KVCacheManager.make_prefix_cache_stats`). A request is looked up once, when it is
    # first scheduled; a request resumed after preemption is looked up again, into the preempted counters,
    # so that its own earlier blocks do not inflate the hit rate. `requests` may be 0 from an engine that
    # does not count them: the log line then counts a step with queries as one request.
    prefix_cache: PrefixCacheStats = field(default_factory=PrefixCacheStats)
    num_preemptions: int = metric_field(  # this step
        "counter", "brine_num_preemptions", "Requests preempted (KV blocks freed, recomputed)."
    )
    # The prefix cache was emptied just before this record: hit rates over a recent window start afresh, since
    # hits from before the reset say nothing about the cache now.
    prefix_cache_reset: bool = False
    # LoRA adapters (--enable-lora; max_lora 0 when off): the adapters of running and of waiting requests after
    # this step (sorted names), and API requests added per adapter since the last record.
    max_lora: int = 0
    running_lora_adapters: tuple[str, ...] = ()
    waiting_lora_adapters: tuple[str, ...] = ()
    lora_requests: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class FinishedRequestStats:
    """One request that finished (any reason) during the step."""

    finish_reason: str  # "stop" | "length" | "abort" | "error" (engine.outputs.FinishReason values)
    num_prompt_tokens: int
    num_generation_tokens: int
    num_cached_tokens: int  # prompt tokens served from the prefix cache at first scheduling
    e2e_latency: float  # arrival -> finish
    # Arrival -> first scheduled (its earliest sequence). None if it never was (aborted while waiting): as in
    # vLLM, no queue time is recorded then; 0.0 would tell the histogram it started at once.
    queue_time: float | None
    ttft: float | None  # arrival -> its earliest sequence's first token; None if no token came
    # One per sequence that generated > 1 token: (its last token - its first token) / (its tokens - 1). Per
    # sequence, like the TTFT histogram (`IterationStats.ttfts`) and vLLM's n child requests: n sequences
    # decode side by side, so pooling their tokens over one stretch of time would be n times too small.
    mean_times_per_output_token: list[float]


@dataclass(slots=True)
class SpecDecodingStats:
    """Speculative decoding in one step, as vLLM counts it: a draft is one request's guesses in one step."""

    num_drafts: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    # Entry i: drafts whose token at position i was accepted (so it never grows along the list).
    num_accepted_tokens_per_pos: list[int] = field(default_factory=list)
    # The least chance of acceptance a draft token needed in this step (engine.spec_decode: min_draft_acceptance,
    # or what a draft row measured to cost, engine.spec_cost); None where not known.
    threshold: float | None = None

    def observe(self, num_draft_tokens: int, num_accepted: int) -> None:
        self.num_drafts += 1
        self.num_draft_tokens += num_draft_tokens
        self.num_accepted_tokens += num_accepted
        per_pos = self.num_accepted_tokens_per_pos
        if len(per_pos) < num_draft_tokens:
            per_pos.extend([0] * (num_draft_tokens - len(per_pos)))
        for i in range(num_accepted):
            per_pos[i] += 1


@dataclass(slots=True)
class IterationStats:
    """Work done in one step."""

    # Prompt tokens computed this step (cache hits are not computed, not counted).
    num_prompt_tokens: int = metric_field(
        "counter",
        "brine_prompt_tokens",
        "Prompt tokens computed by the model (prefix-cache hits are not computed).",
    )
    num_generation_tokens: int = metric_field(  # tokens sampled this step
        "counter", "brine_generation_tokens", "Tokens generated."
    )
    # Prompts that computed nothing this step (engine.kept_logits).
    num_kept_logits_hits: int = metric_field(
        "counter",
        "brine_prefix_cache_kept_logits_hits",
        "Prompts sent again whose every token was cached and whose first token was sampled from the logits kept "
        "after the same prompt: no forward at all.",
    )
    # One per sequence that got its first token this step: a request with n > 1 gives n (as vLLM's n child
    # requests do), so the histogram is the latency each generated choice saw.
    ttfts: list[float] = field(default_factory=list)
    inter_token_latencies: list[float] = field(default_factory=list)  # one per later token this step
    finished: list[FinishedRequestStats] = field(default_factory=list)
    spec_decoding: SpecDecodingStats | None = None  # None: no request verified drafts this step


class StatLogger(Protocol):
    """What the engine calls on every stat logger, directly (no hook is looked up by name).

    `record`: after every step, and after a prefix-cache reset (the engine may then stay idle, with no step to
    refresh the gauges). Never two calls at once: the engine makes them under its core lock.

    The other hooks report events outside a step, each from the thread where it happened, so an
    implementation must take them thread-safely. They do nothing unless overridden: a logger that subclasses
    this Protocol inherits the no-ops and defines only what it exports."""

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None: ...

    def count_structured_output(self, kind: str) -> None:
        """One request with an output constraint of `kind` (engine.structured_output.KINDS), from the
        server's event loop."""
        return None  # a body, so that the hook is a no-op default, not an abstract method

    def observe_grammar_compile(self, seconds: float) -> None:
        """One grammar compiled (a cache miss), from the thread that compiled it."""
        return None  # a body, so that the hook is a no-op default, not an abstract method
