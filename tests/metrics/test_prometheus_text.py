"""What a scraper reads that the other metrics tests do not pin down (found by `make mutate`): each metric's
HELP text, an unforeseen finish reason counted under its own label, the token-count buckets' bounds, and a
registry handed in by the caller being the one filled."""

from __future__ import annotations

from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from metrics.prometheus import PrometheusStatLogger, token_buckets
from metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

HELP = {
    "brine_prefix_cache_queries": "Prompt tokens looked up in the prefix cache, once per request at first scheduling.",
    "brine_prefix_cache_hits": "Of the looked-up prompt tokens, those found in the prefix cache.",
    "brine_prefix_cache_public_hits": (
        "Of the prefix-cache hits, tokens in blocks of a declared public prefix (shared by every tenant)."
    ),
    "brine_kv_retention_expiries": (
        "KV blocks retained for a retention request (prompt_cache_retention, cache_control ttl) whose TTL ran out."
    ),
    "brine_num_retained_blocks": (
        "KV blocks kept in the pool for retention requests until their TTL (never evicted meanwhile)."
    ),
    "brine_prefix_cache_tier_hits": (
        "Of the prefix-cache hits, tokens by the tier that served them: pool (the device KV pool), host "
        "(--kv-host-memory) or disk (--kv-disk-dir); the tiers sum to brine_prefix_cache_hits_total."
    ),
    "brine_prefix_cache_preempted_queries": "Prompt tokens looked up again when a preempted request is rescheduled.",
    "brine_prefix_cache_preempted_hits": "Of the preempted lookups, tokens found in the prefix cache.",
    "brine_prefix_cache_evictions": "Cached KV blocks whose prefix hash was dropped to reuse the block.",
    "brine_num_preemptions": "Requests preempted (KV blocks freed, recomputed).",
    "brine_prompt_tokens": "Prompt tokens computed by the model (prefix-cache hits are not computed).",
    "brine_generation_tokens": "Tokens generated.",
    "brine_prefix_cache_kept_logits_hits": (
        "Prompts sent again whose every token was cached and whose first token was sampled from the logits kept "
        "after the same prompt: no forward at all."
    ),
    "brine_request_success": "Finished requests, by finish reason.",
    "brine_num_requests_running": "Requests in the running batch.",
    "brine_num_requests_waiting": "Requests waiting to be scheduled.",
    "brine_kv_cache_usage_perc": "Fraction of KV cache blocks in use (0..1).",
    "brine_num_cached_blocks": "KV blocks holding a prefix hash (reusable by a later request).",
    "brine_time_to_first_token_seconds": "Arrival to first token, per sequence (a request with n > 1 counts n times).",
    "brine_inter_token_latency_seconds": "Time between consecutive output tokens.",
    "brine_time_per_output_token_seconds": "Per finished sequence with more than one token: mean time per output token after the first.",
    "brine_e2e_request_latency_seconds": "Arrival to finish, per request.",
    "brine_request_queue_time_seconds": "Arrival to first scheduled, per finished request that was scheduled.",
    "brine_request_prompt_tokens": "Prompt length per finished request.",
    "brine_request_generation_tokens": "Generated tokens per finished request.",
    "brine_structured_output_requests": (
        "Requests with a structured-output constraint (forced tool calls count as json_schema), by kind."
    ),
    "brine_grammar_compile_seconds": (
        "Time to compile one structured-output grammar (cache misses only; a cached schema costs none)."
    ),
    "brine_spec_decode_num_drafts": "Drafts verified.",
    "brine_spec_decode_num_draft_tokens": "Draft tokens verified.",
    "brine_spec_decode_num_accepted_tokens": "Draft tokens accepted (the model would have sampled them).",
    "brine_spec_decode_num_accepted_tokens_per_pos": "Drafts whose token at this position (0-based) was accepted.",
    "brine_lora_requests": "Requests added per LoRA adapter.",
    "brine_lora_requests_info": (
        "LoRA adapters of the running and waiting requests (labels), as of the value's Unix time."
    ),
}


def families(logger: PrometheusStatLogger) -> dict:
    body, _ = logger.render()
    return {
        f.name: f for f in text_string_to_metric_families(body.decode()) if not f.name.endswith("_created")
    }


def test_every_metric_says_what_it_counts() -> None:
    assert {name: f.documentation for name, f in families(PrometheusStatLogger("m")).items()} == HELP


def test_an_unforeseen_finish_reason_is_counted_under_its_own_label() -> None:
    logger = PrometheusStatLogger("tiny")
    done = FinishedRequestStats("cancelled", 3, 2, 0, 0.5, 0.1, 0.2, [])
    logger.record(SchedulerStats(), IterationStats(finished=[done, done]))
    samples = {
        s.labels["finished_reason"]: (s.value, s.labels["model_name"])
        for s in families(logger)["brine_request_success"].samples
        if s.name == "brine_request_success_total"
    }
    assert samples["cancelled"] == (2.0, "tiny") and samples["stop"] == (0.0, "tiny")


def test_token_buckets_run_1_2_5_up_to_the_bound_inclusive() -> None:
    assert token_buckets(100) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0, 100.0)
    assert token_buckets(99) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0)
    assert token_buckets()[-1] == 100000.0 and len(token_buckets()) == 16


def test_a_registry_handed_in_is_the_one_filled() -> None:
    registry = CollectorRegistry()
    logger = PrometheusStatLogger("m", registry=registry)
    assert logger.registry is registry
    assert registry.get_sample_value("brine_num_requests_running", {"model_name": "m"}) == 0.0
