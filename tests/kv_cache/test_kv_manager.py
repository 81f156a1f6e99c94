"""KVCacheManager against exact block ids, ref counts and LRU eviction order (block_size 4 throughout)."""

from __future__ import annotations

import pytest
from kv_fakes import FakeRequest, admit, free_queue, make_req, release, snapshot

from kv_cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheNamespace,
    ComputedBlocks,
    KVCacheManager,
    PrefixCacheStats,
    TailHit,
)


def check(mgr: KVCacheManager) -> None:
    mgr.check_invariants()


def test_miss_then_partial_hit() -> None:
    mgr = KVCacheManager(10, 4)
    a = make_req(mgr, "a", range(10))  # blocks [0..3] [4..7] [8, 9]
    computed, new = admit(mgr, a)
    assert computed == ComputedBlocks([], 0)
    assert new == [0, 1, 2]
    assert mgr.get_block_ids("a") == [0, 1, 2]
    # The two full blocks are cached as soon as they are allocated; the partial one is not.
    assert mgr.block_pool.block_hash[:3] == [a.block_hashes[0], a.block_hashes[1], None]
    assert mgr.num_cached_blocks == 2
    assert free_queue(mgr.block_pool) == [3, 4, 5, 6, 7, 8, 9]
    assert mgr.usage == pytest.approx(0.3)
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 10, 0)
    check(mgr)

    b = make_req(mgr, "b", [0, 1, 2, 3, 50, 51, 52, 53, 54])  # shares block 0 only
    computed, new = admit(mgr, b)
    assert computed == ComputedBlocks([0], 4)
    assert new == [3, 4]
    assert mgr.get_block_ids("b") == [0, 3, 4]
    assert mgr.block_pool.ref_cnt[:5] == [2, 1, 1, 1, 1]
    assert mgr.block_pool.block_hash[3] == b.block_hashes[1]
    stats = mgr.make_prefix_cache_stats()
    assert (stats.requests, stats.queries, stats.hits) == (1, 9, 4)
    assert mgr.make_prefix_cache_stats().requests == 0  # reset by the previous call
    release(mgr, a, b)


def test_two_requests_share_a_prefix_then_free_in_lru_order() -> None:
    mgr = KVCacheManager(10, 4)
    a = make_req(mgr, "a", range(10))
    assert admit(mgr, a)[1] == [0, 1, 2]
    b = make_req(mgr, "b", [*range(8), 100, 101, 102])
    computed, new = admit(mgr, b)
    assert computed.block_ids == [0, 1] and computed.num_tokens == 8
    assert new == [3]
    assert mgr.get_block_ids("b") == [0, 1, 3]
    assert mgr.block_pool.ref_cnt[:4] == [2, 2, 1, 1]
    assert free_queue(mgr.block_pool) == [4, 5, 6, 7, 8, 9]
    check(mgr)

    mgr.free(a)  # only its private block 2 becomes free
    assert free_queue(mgr.block_pool) == [4, 5, 6, 7, 8, 9, 2]
    assert mgr.block_pool.ref_cnt[:4] == [1, 1, 0, 1]
    check(mgr)
    mgr.free(b)  # reverse order: the deepest block is evicted first, the shared root last
    assert free_queue(mgr.block_pool) == [4, 5, 6, 7, 8, 9, 2, 3, 1, 0]
    assert mgr.num_free_blocks == 10 and mgr.usage == 0.0
    assert mgr.num_cached_blocks == 2  # freed blocks keep their hashes
    mgr.free(b)  # freeing a request that holds nothing is a no-op
    check(mgr)

    # A revived free hit block leaves the middle of the queue.
    c = make_req(mgr, "c", [*range(8), 7])
    assert admit(mgr, c) == (ComputedBlocks([0, 1], 8), [4])
    assert free_queue(mgr.block_pool) == [5, 6, 7, 8, 9, 2, 3]
    release(mgr, c)


def test_long_miss_evicts_cached_blocks_in_lru_order() -> None:
    mgr = KVCacheManager(8, 4, enable_events=True)
    a = make_req(mgr, "a", range(16))
    assert admit(mgr, a)[1] == [0, 1, 2, 3]
    assert mgr.num_cached_blocks == 4
    mgr.free(a)
    assert free_queue(mgr.block_pool) == [4, 5, 6, 7, 3, 2, 1, 0]
    mgr.take_events()

    b = make_req(mgr, "b", range(100, 124))  # 6 blocks: 4 never-used ones, then a's deepest two
    assert admit(mgr, b)[1] == [4, 5, 6, 7, 3, 2]
    assert free_queue(mgr.block_pool) == [1, 0]
    events = mgr.take_events()
    assert events[0] == BlockRemoved([a.block_hashes[3], a.block_hashes[2]])
    assert isinstance(events[1], BlockStored) and events[1].block_hashes == b.block_hashes
    assert mgr.make_prefix_cache_stats().evictions == 2
    check(mgr)

    # a's first two blocks survived: its prefix still hits up to the first evicted block.
    c = make_req(mgr, "c", range(16))
    assert mgr.get_computed_blocks(c) == ComputedBlocks([0, 1], 8)
    release(mgr, b)


def test_revived_hit_blocks_count_against_the_free_supply() -> None:
    mgr = KVCacheManager(6, 4)
    a = make_req(mgr, "a", range(12))
    assert admit(mgr, a)[1] == [0, 1, 2]
    mgr.free(a)
    b = make_req(mgr, "b", range(100, 116))
    assert admit(mgr, b)[1] == [3, 4, 5, 2]  # evicts a's block 2; blocks 0, 1 stay cached and free
    assert free_queue(mgr.block_pool) == [1, 0]

    c = make_req(mgr, "c", range(12))
    computed = mgr.get_computed_blocks(c)
    assert computed == ComputedBlocks([0, 1], 8)  # capped at 11 tokens -> 2 blocks
    before = snapshot(mgr)
    # 1 new block + 2 revived = 3 > 2 free: refused, and no ref count touched.
    assert mgr.allocate_slots(c, 4, computed) is None
    assert snapshot(mgr) == before
    assert mgr.get_block_ids("c") == []
    check(mgr)

    mgr.free(b)
    assert free_queue(mgr.block_pool) == [1, 0, 2, 5, 4, 3]
    computed = mgr.get_computed_blocks(c)
    assert mgr.allocate_slots(c, 4, computed) == [2]  # revives 0 and 1 first, so 2 is the head
    assert mgr.get_block_ids("c") == [0, 1, 2]
    assert mgr.block_pool.block_hash[2] == c.block_hashes[2]  # b's old block 2 hash was dropped on reuse
    assert mgr.block_pool.get_cached_block(b.block_hashes[3]) is None
    release(mgr, c)


def test_decode_fills_a_block_and_hashes_it() -> None:
    mgr = KVCacheManager(4, 4, enable_events=True)
    a = make_req(mgr, "a", range(6))
    assert admit(mgr, a)[1] == [0, 1]
    assert len(a.block_hashes) == 1 and mgr.num_cached_blocks == 1
    mgr.take_events()

    a.append(6)  # sampled token 7 of 8 in block 1
    assert mgr.allocate_slots(a, 1) == []
    a.num_computed_tokens += 1
    assert mgr.num_cached_blocks == 1 and mgr.take_events() == []

    a.append(7)  # block 1 is now full of known tokens: hashed by the hasher, cached by the manager
    assert len(a.block_hashes) == 2
    assert mgr.allocate_slots(a, 1) == []
    a.num_computed_tokens += 1
    assert mgr.block_pool.block_hash[1] == a.block_hashes[1]
    assert mgr.take_events() == [BlockStored([a.block_hashes[1]], a.block_hashes[0], [4, 5, 6, 7], 4)]

    a.append(8)
    assert mgr.allocate_slots(a, 1) == [2]
    a.num_computed_tokens += 1
    assert mgr.get_block_ids("a") == [0, 1, 2]
    check(mgr)

    # The block of generated tokens is shared like any other.
    b = make_req(mgr, "b", [*range(8), 42])
    assert mgr.get_computed_blocks(b) == ComputedBlocks([0, 1], 8)
    release(mgr, a)


def test_hit_is_capped_on_a_block_aligned_prompt_and_a_hash_may_live_in_two_blocks() -> None:
    mgr = KVCacheManager(4, 4, enable_events=True)
    a = make_req(mgr, "a", range(8))
    assert admit(mgr, a)[1] == [0, 1]
    b = make_req(mgr, "b", range(8))
    computed, new = admit(mgr, b)
    assert computed == ComputedBlocks([0], 4)  # not [0, 1]: the last token must be computed
    assert new == [2]
    # b recomputed block 1's tokens into block 2: both hold the same hash.
    assert mgr.block_pool.block_hash[2] == mgr.block_pool.block_hash[1] == a.block_hashes[1]
    assert mgr.num_cached_blocks == 3
    check(mgr)

    mgr.free(a)
    mgr.free(b)
    assert free_queue(mgr.block_pool) == [3, 1, 2, 0]
    mgr.take_events()
    e = make_req(mgr, "e", [50, 51, 52, 53, 54])
    assert admit(mgr, e)[1] == [3, 1]  # evicts block 1; block 2 still holds the hash
    assert all(not isinstance(ev, BlockRemoved) for ev in mgr.take_events())
    assert mgr.make_prefix_cache_stats().evictions == 1
    c = make_req(mgr, "c", [*range(8), 9])
    assert mgr.get_computed_blocks(c) == ComputedBlocks([0, 2], 8)
    release(mgr, e)


def test_same_salt_hits_and_other_salts_miss_at_every_block() -> None:
    mgr = KVCacheManager(20, 4)
    tokens = list(range(12))
    a = make_req(mgr, "a", tokens, salt="s1")
    assert admit(mgr, a)[1] == [0, 1, 2]
    assert mgr.num_cached_blocks == 3
    b = make_req(mgr, "b", [*tokens, 99], salt="s1")
    assert mgr.get_computed_blocks(b) == ComputedBlocks([0, 1, 2], 12)
    others = [make_req(mgr, f"o{i}", [*tokens, 99], salt=s) for i, s in enumerate(["s2", None, ""])]
    for o in others:
        assert mgr.get_computed_blocks(o) == ComputedBlocks([], 0)
        # Not only the first block: every block's hash differs, because the salt is in the parent chain.
        for i, h in enumerate(o.block_hashes):
            assert h != b.block_hashes[i]
            assert mgr.block_pool.get_cached_block(h) is None
    assert len({o.block_hashes[2] for o in others}) == 3
    release(mgr, a)


def test_caching_disabled_hashes_nothing_and_never_hits() -> None:
    mgr = KVCacheManager(6, 4, enable_caching=False, enable_events=True)
    assert mgr.make_hasher() is None and mgr.make_hasher(CacheNamespace(salt="salt")) is None
    a = make_req(mgr, "a", range(10))
    assert a.block_hashes == []
    assert admit(mgr, a) == (ComputedBlocks([], 0), [0, 1, 2])
    # Even a request that carries hashes (from elsewhere) is neither cached nor looked up.
    other = KVCacheManager(6, 4)
    b = make_req(other, "b", range(10))
    assert len(b.block_hashes) == 2
    assert admit(mgr, b) == (ComputedBlocks([], 0), [3, 4, 5])
    assert mgr.num_cached_blocks == 0 and mgr.block_pool.block_hash == [None] * 6
    assert mgr.make_prefix_cache_stats() == PrefixCacheStats()  # nothing recorded
    assert mgr.take_events() == []
    mgr.free(a)
    mgr.free(b)
    assert free_queue(mgr.block_pool) == [2, 1, 0, 5, 4, 3]
    release(mgr)


def test_allocation_failure_changes_nothing() -> None:
    mgr = KVCacheManager(4, 4, enable_events=True)
    a = make_req(mgr, "a", range(8))
    assert admit(mgr, a)[1] == [0, 1]
    mgr.take_events()
    before = snapshot(mgr)
    b = make_req(mgr, "b", range(100, 112))  # needs 3 blocks, 2 free
    assert admit(mgr, b)[1] is None
    assert snapshot(mgr) == before and mgr.get_block_ids("b") == []
    assert mgr.take_events() == []
    # A running request that cannot grow is refused too, and keeps what it had.
    a.append(8)
    assert mgr.allocate_slots(a, 1 + 12) is None
    assert snapshot(mgr) == before
    check(mgr)
    # Exactly enough succeeds (room reserved beyond the known tokens is allowed, but not cached).
    assert mgr.allocate_slots(a, 8) == [2, 3]
    assert mgr.num_cached_blocks == 2
    assert mgr.num_free_blocks == 0
    release(mgr, a)


def test_hit_blocks_only_for_a_request_holding_none() -> None:
    mgr = KVCacheManager(8, 4)
    a = make_req(mgr, "a", range(10))
    admit(mgr, a)
    b = make_req(mgr, "b", range(10))
    computed = mgr.get_computed_blocks(b)
    assert mgr.block_pool.ref_cnt[:2] == [1, 1]  # lookup takes no references
    b.num_computed_tokens = 4
    before = snapshot(mgr)
    with pytest.raises(ValueError):
        mgr.allocate_slots(b, 2, computed)
    assert snapshot(mgr) == before
    with pytest.raises(ValueError):
        mgr.allocate_slots(a, -1)
    release(mgr, a)


def test_reset_refused_while_in_use() -> None:
    mgr = KVCacheManager(4, 4, enable_events=True)
    a = make_req(mgr, "a", range(8))
    admit(mgr, a)
    mgr.take_events()
    before = snapshot(mgr)
    assert mgr.reset_prefix_cache() is False
    assert snapshot(mgr) == before and mgr.take_events() == []
    mgr.free(a)
    queue = free_queue(mgr.block_pool)
    assert mgr.reset_prefix_cache() is True
    assert mgr.num_cached_blocks == 0 and mgr.block_pool.block_hash == [None] * 4
    assert free_queue(mgr.block_pool) == queue
    assert mgr.take_events() == [AllBlocksCleared()]
    assert mgr.get_computed_blocks(make_req(mgr, "b", range(9))) == ComputedBlocks([], 0)
    release(mgr)


def test_events_describe_the_chain() -> None:
    mgr = KVCacheManager(3, 4, enable_events=True)
    a = make_req(mgr, "a", range(6))
    admit(mgr, a)
    a.append(6, 7)  # two tokens arrive at once (e.g. a speculative step): block 1 fills
    assert mgr.allocate_slots(a, 2) == []
    assert mgr.take_events() == [
        BlockStored([a.block_hashes[0]], None, [0, 1, 2, 3], 4),
        BlockStored([a.block_hashes[1]], a.block_hashes[0], [4, 5, 6, 7], 4),
    ]
    assert mgr.take_events() == []
    mgr.free(a)
    b = make_req(mgr, "b", range(20, 32))
    admit(mgr, b)  # takes 2, then 1, then 0: 1 and 0 lose their hashes
    assert mgr.take_events() == [
        BlockRemoved([a.block_hashes[1], a.block_hashes[0]]),
        BlockStored(b.block_hashes, None, list(range(20, 32)), 4),
    ]
    assert KVCacheManager(3, 4).take_events() == []  # events off
    release(mgr, b)


def test_stats_split_preempted_requests_and_skip_reading() -> None:
    mgr = KVCacheManager(8, 4)
    a = make_req(mgr, "a", range(10))
    admit(mgr, a)
    # Preempted by recompute: blocks freed, progress lost, looked up again from waiting.
    mgr.free(a)
    a.num_computed_tokens = 0
    a.num_preemptions = 1
    computed, new = admit(mgr, a)
    # Its two full blocks, and token 8 of the partial block 2 it left (token 9, the last, is computed).
    assert computed == ComputedBlocks([0, 1], 9, tail=TailHit(2, 1)) and new == [3]
    s = mgr.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits) == (1, 10, 0)
    assert (s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 10, 9)

    # Prompt logprobs need every prompt token computed: no lookup, no stats (but its blocks are cached).
    p = make_req(mgr, "p", range(10), skip_reading_prefix_cache=True)
    assert admit(mgr, p) == (ComputedBlocks([], 0), [4, 5, 6])
    s = mgr.make_prefix_cache_stats()
    assert s.requests == s.queries == s.preempted_requests == 0
    release(mgr, a, p)


def test_zero_new_tokens_and_bad_arguments() -> None:
    mgr = KVCacheManager(4, 4)
    r = FakeRequest("r", [1, 2, 3], mgr.make_hasher())
    assert mgr.allocate_slots(r, 0) == []
    assert mgr.get_block_ids("r") == []
    release(mgr, r)
    with pytest.raises(ValueError):
        KVCacheManager(4, 4, hash_algo="md5")
    with pytest.raises(ValueError):
        KVCacheManager(0, 4)
    with pytest.raises(ValueError):
        KVCacheManager(4, 0)


def test_stats_count_an_admission_once_however_many_lookups_failed_to_allocate() -> None:
    mgr = KVCacheManager(4, 4)
    a = make_req(mgr, "a", range(12))
    admit(mgr, a)  # 3 of 4 blocks held
    mgr.make_prefix_cache_stats()
    b = make_req(mgr, "b", list(range(8)) + [90, 91, 92, 93, 94])  # hits a's first 2 blocks, needs 2 more
    for _ in range(3):  # the scheduler retries the waiting head every step while blocks are short
        computed = mgr.get_computed_blocks(b)
        assert computed == ComputedBlocks([0, 1], 8)
        assert mgr.allocate_slots(b, b.num_tokens - computed.num_tokens, computed) is None
    assert mgr.make_prefix_cache_stats() == PrefixCacheStats()
    mgr.free(a)
    computed, new = admit(mgr, b)
    assert computed.block_ids == [0, 1] and new is not None
    s = mgr.make_prefix_cache_stats()
    assert (s.requests, s.queries, s.hits) == (1, 13, 8)
    release(mgr, b)
