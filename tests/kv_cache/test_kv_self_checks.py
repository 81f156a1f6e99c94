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
from kv_cache.hashing import encode, get_hash_fn, init_none_hash
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


def test_check_invariants_refuses_a_forgotten_block_that_is_cached_again_or_free() -> None:
    pool = BlockPool(4)
    ids = pool.take(2)
    pool.cache(ids, [b"h0", b"h1"], owners=[("tenant", "a")] * 2)
    assert pool.forget(("tenant", "a")) == 2
    pool.check_invariants([ids])  # forgotten while in use, holding no hash: as it should be
    pool.cache(ids[:1], [b"h0"])  # a forgotten block must never become findable again
    with _raises(f"forgotten block {ids[0]} is cached or free"):
        pool.check_invariants([ids])
    pool = BlockPool(4)
    pool.forgotten.add(3)  # free: a forgotten block must still be in use
    with _raises("forgotten block 3 is cached or free"):
        pool.check_invariants([])


def test_cache_refuses_ids_and_hashes_of_different_lengths() -> None:
    pool = BlockPool(4)
    ids = pool.take(2)
    with pytest.raises(ValueError):
        pool.cache(ids, [b"only-one"])
    with pytest.raises(ValueError):
        pool.cache(ids[:1], [b"one", b"two"])
    with pytest.raises(ValueError):  # an owner list of another length is the same mistake
        pool.cache(ids, [b"h0", b"h1"], owners=[("tenant", "a")])


def test_prefix_cache_stats_accumulate() -> None:
    stats = PrefixCacheStats()
    for preempted in (False, True):
        stats.record(10, 4, preempted)
        stats.record(6, 2, preempted)
    assert (stats.requests, stats.queries, stats.hits) == (2, 16, 6)
    assert (stats.preempted_requests, stats.preempted_queries, stats.preempted_hits) == (2, 16, 6)
    assert stats.public_hits == 0  # none given, none counted
    stats.record(8, 8, False, num_public_hits=4)
    assert (stats.hits, stats.public_hits) == (14, 4)


def test_bad_arguments_are_refused_with_a_message_that_says_why() -> None:
    assert BlockPool(1).take(1) == [0]  # one block is a valid pool
    with pytest.raises(ValueError, match=r"^num_blocks must be >= 1, got 0$"):
        BlockPool(0)
    with pytest.raises(ValueError, match=r"^cannot take 2 blocks: only 1 free$"):
        BlockPool(1).take(2)
    mgr = KVCacheManager(8, 4)
    r = make_req(mgr, "r", range(9))
    with pytest.raises(ValueError, match=r"^num_new_tokens must be >= 0, got -1$"):
        mgr.allocate_slots(r, -1)
    admit(mgr, r)
    s = make_req(mgr, "r2", range(9))
    computed = mgr.get_computed_blocks(s)
    assert computed.block_ids
    s.num_computed_tokens = 1  # as if it had been scheduled before: a hit now would double-count
    with pytest.raises(
        ValueError, match=r"^request 'r2' got hit blocks but already holds blocks or computed"
    ):
        mgr.allocate_slots(s, 1, computed)


def test_evictions_are_reported_per_interval() -> None:
    mgr = KVCacheManager(2, 4)
    for round_ in range(3):
        r = make_req(mgr, f"r{round_}", range(100 * round_, 100 * round_ + 8))
        admit(mgr, r)  # evicts the previous round's two cached blocks (none in round 0)
        mgr.free(r)
        assert mgr.make_prefix_cache_stats().evictions == (2 if round_ else 0)


def test_a_salt_with_a_lone_surrogate_hashes_and_stays_distinct() -> None:
    # JSON may carry "\ud800": the salt then holds a lone surrogate, which strict UTF-8 cannot encode.
    for algo in ("sha256", "xxhash"):
        fn = get_hash_fn(algo)
        keys = [BlockHasher(4, fn, cache_salt=s, none_hash=b"p").extra_keys(0) for s in ("\ud800", "\ud801")]
        assert fn(keys[0]) != fn(keys[1])


def test_encode_keeps_what_comes_before_a_big_int_and_names_what_it_cannot_hash() -> None:
    big = 2**70  # beyond int64: the general integer encoding
    assert encode(("a", big)) != encode(("b", big))
    assert encode((big,)) != encode((big + 1,)) and encode([big, 1]) != encode([1])
    assert encode([big, "x"]) != encode([big, "y"])
    with pytest.raises(TypeError, match=r"^cannot hash a float for the prefix cache$"):
        encode((1.5,))
    with pytest.raises(ValueError, match=r"expected one of sha256, sha256_cbor, xxhash, xxhash_cbor$"):
        get_hash_fn("md5")


def test_a_seeded_none_hash_is_derived_with_the_managers_hash_function(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    for algo in ("sha256", "xxhash"):
        fn = get_hash_fn(algo)
        assert BlockHasher(4, fn).none_hash == init_none_hash(fn) == fn(("brine_none_hash", "7"))
        mgr = KVCacheManager(4, 4, hash_algo=algo)
        assert mgr.none_hash == init_none_hash(fn) and mgr.hash_algo == algo
    monkeypatch.delenv("PYTHONHASHSEED")
    assert BlockHasher(4, get_hash_fn("sha256")).none_hash != BlockHasher(4, get_hash_fn("sha256")).none_hash


def test_hasher_and_manager_refuse_bad_arguments_saying_why() -> None:
    fn = get_hash_fn("sha256")
    with pytest.raises(ValueError, match=r"^block_size must be >= 1, got 0$"):
        BlockHasher(0, fn)
    with pytest.raises(TypeError, match=r"^none_hash must be bytes, got str$"):
        BlockHasher(4, fn, none_hash="x")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^block_size must be >= 1, got 0$"):
        KVCacheManager(4, 0)


def test_events_are_off_unless_asked_for() -> None:
    mgr = KVCacheManager(4, 4)
    r = make_req(mgr, "r", range(8))
    admit(mgr, r)
    mgr.free(r)
    assert mgr.take_events() == []


def test_manager_check_invariants_catches_blocks_cached_while_caching_is_off() -> None:
    mgr = KVCacheManager(4, 4, enable_caching=False)
    mgr.check_invariants()
    pool = mgr.block_pool
    ids = pool.take(1)
    pool.cache(ids, [b"h"])  # consistent for the pool, but the manager never caches
    pool.free(ids)
    with pytest.raises(AssertionError, match=r"^blocks cached while caching is off$"):
        mgr.check_invariants()
