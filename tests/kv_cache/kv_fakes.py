"""A tiny request satisfying kv_cache.CacheRequest, and a one-step scheduling helper for the kv_cache tests."""

from __future__ import annotations

from dataclasses import dataclass, field

from kv_cache import BlockHash, BlockHasher, BlockPool, CacheNamespace, ComputedBlocks, KVCacheManager


@dataclass
class FakeRequest:
    request_id: str
    all_token_ids: list[int]
    hasher: BlockHasher | None = None
    num_computed_tokens: int = 0
    block_hashes: list[BlockHash] = field(default_factory=list)
    skip_reading_prefix_cache: bool = False
    num_preemptions: int = 0

    def __post_init__(self) -> None:
        if self.hasher is not None:
            self.hasher.extend(self.block_hashes, self.all_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    def append(self, *tokens: int) -> None:
        """A generated token arrives: keep block_hashes current, as engine.Request does."""
        self.all_token_ids.extend(tokens)
        if self.hasher is not None:
            self.hasher.extend(self.block_hashes, self.all_token_ids)


def make_req(
    mgr: KVCacheManager, rid: str, tokens: list[int] | range, salt: str | None = None, **kw: object
) -> FakeRequest:
    namespace = CacheNamespace(salt=salt) if salt is not None else None
    return FakeRequest(rid, list(tokens), mgr.make_hasher(namespace, list(tokens)), **kw)  # type: ignore[arg-type]


def admit(
    mgr: KVCacheManager, req: FakeRequest, num_new_tokens: int | None = None
) -> tuple[ComputedBlocks, list[int] | None]:
    """Schedule a waiting request the way the scheduler does: look up its prefix, then allocate the rest (all of
    it by default). On success the request's tokens count as computed."""
    computed = mgr.get_computed_blocks(req)
    n = req.num_tokens - computed.num_tokens if num_new_tokens is None else num_new_tokens
    new = mgr.allocate_slots(req, n, computed)
    if new is not None:
        req.num_computed_tokens += computed.num_tokens + n
    return computed, new


def release(mgr: KVCacheManager, *reqs: FakeRequest) -> None:
    """End of a test: free every request still holding blocks, then check that no block leaked."""
    for req in reqs:
        mgr.free(req)
    mgr.check_invariants()
    assert mgr.num_free_blocks == mgr.num_blocks, "blocks leaked"
    assert mgr.block_pool.ref_cnt == [0] * mgr.num_blocks
    assert mgr.usage == 0.0


def snapshot(mgr: KVCacheManager) -> tuple[object, ...]:
    """Everything observable about the manager's state, for 'nothing changed' assertions."""
    pool = mgr.block_pool
    return (
        list(pool.ref_cnt),
        list(pool.block_hash),
        free_queue(pool),
        {rid: list(mgr.get_block_ids(rid)) for rid in list(mgr._req_blocks)},
        dict(mgr._num_cached),
        pool.num_cached_blocks,
    )


def free_queue(pool: BlockPool) -> list[int]:
    """The pool's free queue, head (next to be allocated) first: what the eviction-order tests compare with
    exact block ids. Read here, from the queue itself, since nothing in the engine needs the whole order."""
    return list(pool._free)
