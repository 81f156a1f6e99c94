"""What the prefix cache reports upward: per-request hit statistics and the block events an external router
(one that routes requests to the replica already holding their prefix) consumes. Torch-free records only.

`PrefixCacheStats` is the one record of the prefix cache's counters: the manager fills it, the engine hands
it on whole inside `metrics.stats.SchedulerStats.prefix_cache`, and the stat loggers read its fields. A field
that declares its metric (`metadata={"metric": (kind, name, help)}`, kind "counter": increased by the value of
every record, or "gauge": set to it) is exported by `metrics.prometheus` as it is. So a new counter is a
field here, the line in `KVCacheManager` that counts it, and its row in docs/metrics.md; nothing between them
lists the fields again."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from kv_cache.hashing import BlockHash


def metric_field(kind: str, name: str, doc: str, default: float = 0) -> Any:
    """A numeric field whose metric `metrics.prometheus` exports as declared: a "counter" (increased by the
    field's value in every record) or a "gauge" (set to it), named `name`, with `doc` as its HELP."""
    return field(default=default, metadata={"metric": (kind, name, doc)})


@dataclass(slots=True)
class PrefixCacheStats:
    """Counts since the last `KVCacheManager.make_prefix_cache_stats()`. Queries and hits are in tokens.

    A request is counted once per lookup (each time it is scheduled from waiting). Lookups of requests that
    were preempted before (`num_preemptions > 0`) go to the `preempted_*` counters, so that recomputation after
    preemption does not inflate the hit rate of fresh traffic. Lookups skipped because caching is off or the
    request skips the cache (prompt logprobs) are not counted at all.
    """

    requests: int = 0
    queries: int = metric_field(
        "counter",
        "brine_prefix_cache_queries",
        "Prompt tokens looked up in the prefix cache, once per request at first scheduling.",
    )
    hits: int = metric_field(
        "counter",
        "brine_prefix_cache_hits",
        "Of the looked-up prompt tokens, those found in the prefix cache.",
    )
    preempted_requests: int = 0
    preempted_queries: int = metric_field(
        "counter",
        "brine_prefix_cache_preempted_queries",
        "Prompt tokens looked up again when a preempted request is rescheduled.",
    )
    preempted_hits: int = metric_field(
        "counter",
        "brine_prefix_cache_preempted_hits",
        "Of the preempted lookups, tokens found in the prefix cache.",
    )
    # Of `hits`, tokens in blocks of a declared public prefix (shared by every namespace).
    public_hits: int = metric_field(
        "counter",
        "brine_prefix_cache_public_hits",
        "Of the prefix-cache hits, tokens in blocks of a declared public prefix (shared by every tenant).",
    )
    # Cached blocks whose hash was dropped because the block was reallocated.
    evictions: int = metric_field(
        "counter",
        "brine_prefix_cache_evictions",
        "Cached KV blocks whose prefix hash was dropped to reuse the block.",
    )
    # Of `hits`, tokens loaded from a tier behind the pool ("host" | "disk"): the rest came from the pool.
    # Exported by hand (a label per tier, the pool's share derived): no declared metric.
    tier_hits: dict[str, int] = field(default_factory=dict)
    # Blocks held for retention requests now (kv_cache.retention).
    retained_blocks: int = metric_field(
        "gauge",
        "brine_num_retained_blocks",
        "KV blocks kept in the pool for retention requests until their TTL (never evicted meanwhile).",
    )
    # Retained blocks whose TTL ran out.
    retention_expiries: int = metric_field(
        "counter",
        "brine_kv_retention_expiries",
        "KV blocks retained for a retention request (prompt_cache_retention, cache_control ttl) whose TTL ran out.",
    )

    def record(self, num_tokens: int, num_hits: int, preempted: bool, num_public_hits: int = 0) -> None:
        if preempted:
            self.preempted_requests += 1
            self.preempted_queries += num_tokens
            self.preempted_hits += num_hits
        else:
            self.requests += 1
            self.queries += num_tokens
            self.hits += num_hits
            self.public_hits += num_public_hits

    def record_tiers(self, tier_hits: dict[str, int]) -> None:
        for tier, n in tier_hits.items():
            self.tier_hits[tier] = self.tier_hits.get(tier, 0) + n


@dataclass(slots=True)
class BlockStored:
    """Consecutive blocks of one request became cached. `block_hashes[i]` holds
    `token_ids[i * block_size : (i + 1) * block_size]`; `parent_block_hash` is the hash of the block before the
    first one (None when the first one is block 0 of its sequence).

    `lora_name`: the operator's name of the LoRA adapter the blocks were computed with (None: the base model),
    sent in vLLM's field so that a router can route by adapter. No namespace: a tenant or salt is folded into the
    hashes and never appears in an event."""

    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_name: str | None = None


@dataclass(slots=True)
class BlockRemoved:
    """These hashes are no longer held by any block (a hash cached in two blocks is removed with the last)."""

    block_hashes: list[BlockHash] = field(default_factory=list)


@dataclass(slots=True)
class AllBlocksCleared:
    """The prefix cache was reset: no hash is held any more."""


KVCacheEvent = BlockStored | BlockRemoved | AllBlocksCleared
