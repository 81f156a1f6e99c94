"""The kv_cache's self-checks and small contracts that the behavioural tests never violate, so nothing else
would notice them breaking (found by `make mutate`): each `check_invariants` clause catches the corruption it
names, `BlockPool.cache` refuses ids and hashes of different lengths, a multimodal item touches exactly the
blocks its placeholder tokens lie in, and hit statistics accumulate.
"""

from __future__ import annotations

import re

import pytest
from kv_fakes import admit, make_req

from kv_cache import BlockHasher, KVCacheManager
from kv_cache.block_pool import BlockPool
from kv_cache.hashing import get_hash_fn
from kv_cache.stats import PrefixCacheStats


def _raises(message: str):
    """The AssertionError with exactly this message (so a changed message is caught too)."""
    return pytest.raises(AssertionError, match=f"^{re.escape(message)}$")


def _pool_with_cached_blocks() -> BlockPool:
    pool = BlockPool(4)
    ids = pool.take(2)
    pool.cache(ids, [b"h0", b"h1"])
    pool.free(reversed(ids))
    pool.check_invariants([])
    return pool


def test_block_pool_check_invariants_names_each_corruption() -> None:
    pool = _pool_with_cached_blocks()
    with pytest.raises(AssertionError, match="lists a block twice"):
        pool.check_invariants([[2, 2]])

    pool.block_hash.append(None)  # one list out of step with num_blocks, the other not
    with pytest.raises(AssertionError):
        pool.check_invariants([])
    pool.block_hash.pop()
    pool.check_invariants([])

    pool.ref_cnt[3] = 1  # referenced, yet free and held by nobody
    with pytest.raises(AssertionError, match="ref counts"):
        pool.check_invariants([])
    with _raises("free queue != unreferenced blocks"):
        pool.check_invariants([[3]])
    pool.ref_cnt[3] = 0

    pool.num_cached_blocks += 1
    with _raises("num_cached_blocks is off"):
        pool.check_invariants([])
    pool.num_cached_blocks -= 1

    pool._cached[b"ghost"] = 3
    with _raises("hash map keys != hashes held by blocks"):
        pool.check_invariants([])
    del pool._cached[b"ghost"]

    pool._dups[b"h0"] = []  # an empty duplicate list for a hash that is cached
    with _raises("stale duplicate entries"):
        pool.check_invariants([])
    pool._dups[b"nowhere"] = [2]  # a non-empty one for a hash that is not
    del pool._dups[b"h0"]
    with _raises("stale duplicate entries"):
        pool.check_invariants([])
    del pool._dups[b"nowhere"]
    pool.check_invariants([])


def test_manager_check_invariants_names_each_corruption() -> None:
    mgr = KVCacheManager(8, 4)
    r = make_req(mgr, "r", range(9))
    admit(mgr, r)
    mgr.check_invariants()
    mgr._num_cached["ghost"] = 0
    with _raises("cached-block counts for unknown requests"):
        mgr.check_invariants()
    del mgr._num_cached["ghost"]
    mgr.check_invariants()


def test_cache_refuses_ids_and_hashes_of_different_lengths() -> None:
    pool = BlockPool(4)
    ids = pool.take(2)
    with pytest.raises(ValueError):
        pool.cache(ids, [b"only-one"])
    with pytest.raises(ValueError):
        pool.cache(ids[:1], [b"one", b"two"])


def test_a_multimodal_item_touches_only_the_blocks_its_tokens_lie_in() -> None:
    # Block size 4: an item over tokens 2..3 ends exactly where block 1 starts, one over 4..7 fills block 1.
    hasher = BlockHasher(
        4, get_hash_fn("sha256"), mm_items=[("img-a", 2, 2), ("img-b", 4, 4), ("img-c", 11, 3)]
    )
    assert hasher.extra_keys(0) == (("mm", "img-a", 2),)
    assert hasher.extra_keys(1) == (("mm", "img-b", 4),)
    assert hasher.extra_keys(2) == (("mm", "img-c", 11),)
    assert hasher.extra_keys(3) == (("mm", "img-c", 11),)
    assert hasher.extra_keys(4) is None


def test_prefix_cache_stats_accumulate() -> None:
    stats = PrefixCacheStats()
    for preempted in (False, True):
        stats.record(10, 4, preempted)
        stats.record(6, 2, preempted)
    assert (stats.requests, stats.queries, stats.hits) == (2, 16, 6)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (2, 16, 6)
