"""The records a prefix-cache lookup reads and returns: `CacheRequest` (what the manager reads from a request)
and `ComputedBlocks` (the longest hit, with its `TailHit`).

Their own module because both the manager and the tier bridge speak them (`kv_cache.manager` imports
`kv_cache.tier_bridge`), so neither has to import the other for them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from kv_cache.hashing import BlockHash, BlockHasher


class CacheRequest(Protocol):
    """What the manager reads from a request (engine.Request satisfies it)."""

    request_id: str
    all_token_ids: list[int]  # prompt + generated
    num_computed_tokens: int
    block_hashes: list[BlockHash]  # kept current by a BlockHasher (empty when caching is off)
    hasher: BlockHasher | None  # from make_hasher; None when caching is off
    num_preemptions: int  # > 0 once the request has been preempted

    @property
    def skip_reading_prefix_cache(self) -> bool:  # True when prompt logprobs are asked for
        ...

    @property
    def num_tokens(self) -> int:  # == len(all_token_ids)
        ...


@dataclass(frozen=True, slots=True)
class TailHit:
    """The leading tokens of a request's next block that `block` already holds the KV of."""

    block: int
    num_tokens: int  # 1 .. block_size - 1


@dataclass(slots=True)
class ComputedBlocks:
    block_ids: list[int]
    num_tokens: int  # len(block_ids) * block_size, plus tail.num_tokens
    # Tokens looked up (the request's length); 0 when no lookup happened (caching off, prompt logprobs).
    # allocate_slots counts the query and the hit only when the admission succeeds, so a request that
    # waits several steps for blocks is counted once, as the metrics promise.
    num_queried_tokens: int = field(default=0, compare=False)
    # Of num_tokens, those in blocks of a declared public prefix (hashed without namespace).
    num_public_tokens: int = field(default=0, compare=False)
    # Reused part of the next block: allocate_slots gives the request a new block, copied from tail.block.
    tail: TailHit | None = None
    # The tier ("host" | "disk") of each block after block_ids that a tier holds (kv_cache.tier_bridge): such a
    # hit goes to start_load, not allocate_slots. num_tokens counts these blocks too.
    load: list[str] = field(default_factory=list, compare=False)
