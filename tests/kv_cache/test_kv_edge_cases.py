"""KVCacheManager edge cases: revived hit blocks at the head of a nearly empty free queue, a request preempted
with blocks only partly cached, and a hash held by two blocks evicted in either order (block_size 4)."""

from __future__ import annotations

from kv_fakes import admit, free_queue, make_req, release, snapshot

from kv_cache import BlockRemoved, BlockStored, ComputedBlocks, KVCacheManager, TailHit


def test_revived_hit_blocks_at_the_queue_head_on_an_exactly_full_pool() -> None:
    mgr = KVCacheManager(5, 4, enable_events=True)
    a = make_req(mgr, "a", range(8))
    assert admit(mgr, a)[1] == [0, 1]
    mgr.free(a)
    b = make_req(mgr, "b", range(100, 108))
    assert admit(mgr, b)[1] == [2, 3]
    d = make_req(mgr, "d", range(200, 204))
    assert admit(mgr, d)[1] == [4]
    assert free_queue(mgr.block_pool) == [1, 0]  # a's cached blocks, next in line for eviction
    mgr.take_events()

    c = make_req(mgr, "c", [*range(8), *range(300, 309)])  # 17 tokens: 5 blocks, the first 2 hit
    computed = mgr.get_computed_blocks(c)
    assert computed == ComputedBlocks([0, 1], 8)
    for victim in (None, d):  # 3 new + 2 revived blocks: refused with 2, then 3 free blocks
        if victim is not None:
            mgr.free(victim)
        before = snapshot(mgr)
        assert mgr.allocate_slots(c, 9, computed) is None
        assert snapshot(mgr) == before and mgr.take_events() == []
        mgr.check_invariants()

    mgr.free(b)
    assert free_queue(mgr.block_pool) == [1, 0, 4, 3, 2]
    # Exactly enough: the hit blocks are revived first, so the new blocks never evict them.
    assert mgr.allocate_slots(c, 9, computed) == [4, 3, 2]
    c.num_computed_tokens = 17
    assert mgr.get_block_ids("c") == [0, 1, 4, 3, 2] and mgr.num_free_blocks == 0
    assert mgr.take_events() == [
        BlockRemoved([d.block_hashes[0], b.block_hashes[1], b.block_hashes[0]]),
        BlockStored(c.block_hashes[2:4], c.block_hashes[1], list(range(300, 308)), 4),
    ]
    release(mgr, c)


def test_preempted_with_a_partly_cached_block_table() -> None:
    mgr = KVCacheManager(6, 4, enable_events=True)
    r = make_req(mgr, "r", range(10))
    assert len(r.block_hashes) == 2  # the hasher knows both full blocks from the start
    assert admit(mgr, r, 6)[1] == [0, 1]  # a first chunk of 6 tokens: only block 0 is computed
    assert mgr.block_pool.block_hash[:2] == [r.block_hashes[0], None]
    assert mgr.take_events() == [BlockStored([r.block_hashes[0]], None, [0, 1, 2, 3], 4)]

    mgr.free(r)  # preempted by recompute
    r.num_computed_tokens = 0
    r.num_preemptions = 1
    assert free_queue(mgr.block_pool) == [2, 3, 4, 5, 1, 0]
    assert mgr.block_pool.get_cached_block(r.block_hashes[1]) is None  # never computed, never cached

    computed, new = admit(mgr, r)
    # Block 0 by hash; then tokens 4 and 5, which block 1 still holds (filed as a partial when freed).
    assert computed == ComputedBlocks([0], 6, tail=TailHit(1, 2))
    assert new == [2, 3]
    assert mgr.end_pass() == [(1, 2)]  # the step copies them into the request's own block first
    assert mgr.get_block_ids("r") == [0, 2, 3]
    assert mgr.block_pool.block_hash[2] == r.block_hashes[1]
    assert mgr.take_events() == [BlockStored([r.block_hashes[1]], r.block_hashes[0], [4, 5, 6, 7], 4)]
    s = mgr.make_prefix_cache_stats()
    assert (s.requests, s.preempted_requests, s.preempted_queries, s.preempted_hits) == (1, 1, 10, 6)
    release(mgr, r)


def test_a_hash_in_two_blocks_is_removed_with_its_last_holder_in_either_order() -> None:
    for evict_copy_first in (True, False):
        mgr = KVCacheManager(4, 4, enable_events=True)
        a = make_req(mgr, "a", range(8))
        assert admit(mgr, a)[1] == [0, 1]
        b = make_req(mgr, "b", range(8))  # hit capped at block 0: block 1 recomputed into block 2
        assert admit(mgr, b) == (ComputedBlocks([0], 4), [2])
        h1 = a.block_hashes[1]
        assert mgr.block_pool.get_cached_block(h1) == 1  # the first block cached under h1 is found
        first, second = (b, a) if evict_copy_first else (a, b)
        mgr.free(first)
        mgr.free(second)
        # The block freed first is evicted first (after the never-used block 3).
        copy, original = (2, 1) if evict_copy_first else (1, 2)
        assert free_queue(mgr.block_pool) == [3, copy, original, 0]
        mgr.take_events()

        e = make_req(mgr, "e", range(50, 58))
        assert admit(mgr, e)[1] == [3, copy]
        assert all(not isinstance(ev, BlockRemoved) for ev in mgr.take_events())
        assert mgr.block_pool.get_cached_block(h1) == original  # the map keeps the other holder
        c = make_req(mgr, "c", [*range(8), 9])
        assert mgr.get_computed_blocks(c) == ComputedBlocks([0, original], 8)
        mgr.check_invariants()

        f = make_req(mgr, "f", range(60, 63))
        assert admit(mgr, f)[1] == [original]
        assert mgr.take_events()[0] == BlockRemoved([h1])  # the last holder went: now it is gone
        assert mgr.get_computed_blocks(c) == ComputedBlocks([0], 4)
        release(mgr, e, f)
