"""What the prefix cache reports upward: per-request hit statistics and the block events an external router
(one that routes requests to the replica already holding their prefix) consumes. Torch-free records only.

`PrefixCacheStats` is the one record of the prefix cache's counters: the manager fills it, the engine hands
it on whole inside `metrics.stats.SchedulerStats.prefix_cache`, and the stat loggers read its fields. A new
counter is a field here, the line in `KVCacheManager` that counts it, and its metric in
`metrics/prometheus.py`; nothing between them lists the fields again."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_cache.hashing import BlockHash


@dataclass(slots=True)
class PrefixCacheStats:
    """Counts since the last `KVCacheManager.make_prefix_cache_stats()`. Queries and hits are in tokens.

    A request is counted once per lookup (each time it is scheduled from waiting). Lookups of requests that
    were preempted before (`num_preemptions > 0`) go to the `preempted_*` counters, so that recomputation after
    preemption does not inflate the hit rate of fresh traffic. Lookups skipped because caching is off or the
    request skips the cache (prompt logprobs) are not counted at all.
    """

    requests: int = 0
    queries: int = 0
    hits: int = 0
    preempted_requests: int = 0
    preempted_queries: int = 0
    preempted_hits: int = 0
    # Of `hits`, tokens in blocks of a declared public prefix (shared by every namespace).
    public_hits: int = 0
    evictions: int = 0  # cached blocks whose hash was dropped because the block was reallocated
    # Of `hits`, tokens loaded from a tier behind the pool ("host" | "disk"): the rest came from the pool.
    tier_hits: dict[str, int] = field(default_factory=dict)
    retained_blocks: int = 0  # blocks held for retention requests now (kv_cache.retention)
    retention_expiries: int = 0  # retained blocks whose TTL ran out

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
