"""Prometheus exporter: turns the engine's per-step stats into the text a scraper reads at `GET /metrics`.

Every metric is named `brine_*` and carries one label, `model_name`, plus `finished_reason` on the request
counter. Nothing tenant-specific ever becomes a label (no cache salt, no API key): labels are public to
whoever can scrape, and a per-tenant label would also grow the series count without bound.

The plain counters and gauges are declared where their value is: on the fields of `SchedulerStats`,
`IterationStats` and kv_cache's `PrefixCacheStats` (`kv_cache.stats.metric_field`), and exported from there
as they are, so adding one touches its record, the line that fills it and docs/metrics.md, not this file.
Labelled series, histograms and derived values (the pool's share of the tier hits) are written out here.

Each logger owns its own `CollectorRegistry`, so two engines (or two tests) in one process never share or
collide on series. Counters start at 0 when the logger is built and are never reset: resetting the prefix
cache empties the cache, not the history of what it served.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import fields

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from kv_cache.stats import PrefixCacheStats
from metrics.stats import IterationStats, SchedulerStats, SpecDecodingStats, StatLogger

# Pre-created so every reason is exported as 0 before the first request finishes: a scraper computing
# rate() needs the series to exist before it increments.
FINISH_REASONS = ("stop", "length", "abort", "error")

# Structured-output kinds (`engine.structured_output.KINDS`), pre-created for the same reason.
STRUCTURED_OUTPUT_KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
GRAMMAR_COMPILE_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)

# Bucket bounds in seconds, wide enough for a 2-core CPU (slow) and a GPU (fast) alike.
TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)  # fmt: skip
TPOT_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
                10.0, 20.0, 80.0)  # fmt: skip
LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0)  # fmt: skip


def token_buckets(max_tokens: int = 131072) -> tuple[float, ...]:
    """1, 2, 5, 10, 20, 50, ... up to max_tokens: request sizes span five orders of magnitude."""
    out: list[float] = []
    base = 1
    while True:
        for m in (1, 2, 5):
            if m * base > max_tokens:
                return tuple(out)
            out.append(float(m * base))
        base *= 10


KV_TIERS = ("pool", "host", "disk")  # where a prefix-cache hit's KV came from (engine.kv_tiers)


class PrometheusStatLogger(StatLogger):
    """A `StatLogger` that keeps Prometheus metrics; `render()` serves them."""

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.model_name = model_name
        self.registry = registry if registry is not None else CollectorRegistry(auto_describe=True)
        # record() runs on the engine's step thread, render() on the server's: the lock keeps a scrape from
        # seeing half a step (queries counted, hits not yet), which would show a false hit rate.
        self._lock = threading.Lock()
        reg, label = self.registry, ["model_name"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, label, registry=reg).labels(model_name)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, label, registry=reg).labels(model_name)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Histogram:
            return Histogram(name, doc, label, buckets=buckets, registry=reg).labels(model_name)

        # The plain counters and gauges the records declare on their fields (`metric_field`), exported as
        # they are: (field, Counter.inc or Gauge.set) per record type. Counters: prometheus-client appends
        # `_total` to the exposed sample name.
        self._declared: dict[type, list[tuple[str, Callable[[float], None]]]] = {}
        for record_type in (SchedulerStats, PrefixCacheStats, IterationStats):
            exports = self._declared[record_type] = []
            for f in fields(record_type):
                if "metric" in f.metadata:
                    kind, name, doc = f.metadata["metric"]
                    exports.append(
                        (f.name, counter(name, doc).inc if kind == "counter" else gauge(name, doc).set)
                    )
        success = Counter(
            "brine_request_success",
            "Finished requests, by finish reason.",
            ["model_name", "finished_reason"],
            registry=reg,
        )
        self.request_success = {r: success.labels(model_name, r) for r in FINISH_REASONS}
        self._success_family = success

        tier_hits = Counter(
            "brine_prefix_cache_tier_hits",
            "Of the prefix-cache hits, tokens by the tier that served them: pool (the device KV pool), host "
            "(--kv-host-memory) or disk (--kv-disk-dir); the tiers sum to brine_prefix_cache_hits_total.",
            ["model_name", "tier"],
            registry=reg,
        )
        self.prefix_cache_tier_hits = {t: tier_hits.labels(model_name, t) for t in KV_TIERS}
        # vLLM's lora_requests_info: one series, its labels the adapters of running and waiting requests
        # (comma-separated names), its value when they were last recorded; cleared each step, so a scrape sees
        # the current adapters only. Requests per adapter: a counter labelled by adapter name, never by tenant.
        self._lora_info = Gauge(
            "brine_lora_requests_info",
            "LoRA adapters of the running and waiting requests (labels), as of the value's Unix time.",
            ["model_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"],
            registry=reg,
        )
        self._lora_requests = Counter(
            "brine_lora_requests",
            "Requests added per LoRA adapter.",
            ["model_name", "lora_name"],
            registry=reg,
        )

        # Histograms.
        self.ttft = histogram(
            "brine_time_to_first_token_seconds",
            "Arrival to first token, per sequence (a request with n > 1 counts n times).",
            TTFT_BUCKETS,
        )
        self.inter_token_latency = histogram(
            "brine_inter_token_latency_seconds", "Time between consecutive output tokens.", TPOT_BUCKETS
        )
        self.time_per_output_token = histogram(
            "brine_time_per_output_token_seconds",
            "Per finished sequence with more than one token: mean time per output token after the first.",
            TPOT_BUCKETS,
        )
        self.e2e_latency = histogram(
            "brine_e2e_request_latency_seconds", "Arrival to finish, per request.", LATENCY_BUCKETS
        )
        self.queue_time = histogram(
            "brine_request_queue_time_seconds",
            "Arrival to first scheduled, per finished request that was scheduled.",
            LATENCY_BUCKETS,
        )
        self.prompt_length = histogram(
            "brine_request_prompt_tokens", "Prompt length per finished request.", token_buckets()
        )
        self.generation_length = histogram(
            "brine_request_generation_tokens", "Generated tokens per finished request.", token_buckets()
        )

        # Speculative decoding, as vLLM names it (vllm:spec_decode_*): a draft is one request's guesses in one
        # step; position i counts the drafts whose i-th token was accepted.
        self.spec_decode_num_drafts = counter("brine_spec_decode_num_drafts", "Drafts verified.")
        self.spec_decode_num_draft_tokens = counter(
            "brine_spec_decode_num_draft_tokens", "Draft tokens verified."
        )
        self.spec_decode_num_accepted_tokens = counter(
            "brine_spec_decode_num_accepted_tokens",
            "Draft tokens accepted (the model would have sampled them).",
        )
        self._spec_per_pos = Counter(
            "brine_spec_decode_num_accepted_tokens_per_pos",
            "Drafts whose token at this position (0-based) was accepted.",
            ["model_name", "position"],
            registry=reg,
        )
        self.spec_decode_num_accepted_tokens_per_pos: list[Counter] = []

        structured = Counter(
            "brine_structured_output_requests",
            "Requests with a structured-output constraint (forced tool calls count as json_schema), by kind.",
            ["model_name", "kind"],
            registry=reg,
        )
        self.structured_output_requests = {
            k: structured.labels(model_name, k) for k in STRUCTURED_OUTPUT_KINDS
        }
        self.grammar_compile_time = histogram(
            "brine_grammar_compile_seconds",
            "Time to compile one structured-output grammar (cache misses only; a cached schema costs none).",
            GRAMMAR_COMPILE_BUCKETS,
        )

    def count_structured_output(self, kind: str) -> None:
        """One structured-output request, from the server's event loop (not a step record)."""
        child = self.structured_output_requests.get(kind)
        if child is not None:
            child.inc()

    def _record_lora(self, s: SchedulerStats) -> None:
        self._lora_info.clear()
        self._lora_info.labels(
            self.model_name,
            str(s.max_lora),
            ",".join(s.running_lora_adapters),
            ",".join(s.waiting_lora_adapters),
        ).set_to_current_time()
        for name, n in s.lora_requests.items():
            self._lora_requests.labels(self.model_name, name).inc(n)

    def observe_grammar_compile(self, seconds: float) -> None:
        """One grammar compilation, from the worker thread that compiled it."""
        self.grammar_compile_time.observe(seconds)

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        s, it = scheduler_stats, iteration_stats
        with self._lock:
            # Counter.inc(0) is legal; negative values would raise, which is the engine's bug to see.
            for record in (s, s.prefix_cache, it):
                for name, export in self._declared[type(record)]:
                    export(getattr(record, name))
            if s.max_lora:
                self._record_lora(s)
            self._record_tier_hits(s.prefix_cache)
            if it.spec_decoding is not None:
                self._record_spec(it.spec_decoding)
            for t in it.ttfts:
                self.ttft.observe(t)
            for t in it.inter_token_latencies:
                self.inter_token_latency.observe(t)
            for f in it.finished:
                # An engine may hand over its FinishReason enum: use its value, never str(enum).
                reason = str(getattr(f.finish_reason, "value", f.finish_reason))
                child = self.request_success.get(reason)
                if child is None:  # an unknown reason still gets counted, under its own label
                    child = self.request_success[reason] = self._success_family.labels(
                        self.model_name, reason
                    )
                child.inc()
                self.e2e_latency.observe(f.e2e_latency)
                if f.queue_time is not None:  # None: never scheduled, so it has no queue time to tell
                    self.queue_time.observe(f.queue_time)
                self.prompt_length.observe(f.num_prompt_tokens)
                self.generation_length.observe(f.num_generation_tokens)
                for t in f.mean_times_per_output_token:  # one per sequence with > 1 token
                    self.time_per_output_token.observe(t)

    def _record_tier_hits(self, pc: PrefixCacheStats) -> None:
        """The hits by tier: a label per tier, the pool's share what the tiers did not serve."""
        from_tiers = 0
        for tier, n in pc.tier_hits.items():
            child = self.prefix_cache_tier_hits.get(tier)
            if child is not None:
                child.inc(n)
                from_tiers += n
        self.prefix_cache_tier_hits["pool"].inc(max(0, pc.hits - from_tiers))

    def _record_spec(self, sd: SpecDecodingStats) -> None:
        self.spec_decode_num_drafts.inc(sd.num_drafts)
        self.spec_decode_num_draft_tokens.inc(sd.num_draft_tokens)
        self.spec_decode_num_accepted_tokens.inc(sd.num_accepted_tokens)
        per_pos = self.spec_decode_num_accepted_tokens_per_pos
        for pos, n in enumerate(sd.num_accepted_tokens_per_pos):
            if pos == len(per_pos):  # a series per position once a draft reaches it
                per_pos.append(self._spec_per_pos.labels(self.model_name, str(pos)))
            per_pos[pos].inc(n)

    def render(self) -> tuple[bytes, str]:
        """(body, content type) for `GET /metrics`, in the Prometheus text format."""
        with self._lock:
            return generate_latest(self.registry), CONTENT_TYPE_LATEST
