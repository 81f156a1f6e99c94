"""Token-granular reuse past the last full-block hit (the tail): which block and how many tokens a lookup
reuses, the copy the step must make, and that a tail never crosses namespaces, never comes from a block the
coming step has still to compute, and goes with its block."""

from __future__ import annotations

import pytest
from kv_fakes import FakeRequest, admit, free_queue, make_req, release

from kv_cache import (
    HASH_ALGOS,
    BlockHasher,
    CacheNamespace,
    ComputedBlocks,
    KVCacheManager,
    TailHit,
    get_hash_fn,
)

BS = 4


def finish(mgr: KVCacheManager, req: FakeRequest) -> None:
    """Its step ran (end_pass), then it finished: its blocks are freed."""
    mgr.end_pass()
    mgr.free(req)
    mgr.check_invariants()


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_tail_key_is_the_block_hash_without_its_tokens(algo: str) -> None:
    fn = get_hash_fn(algo)
    ns = CacheNamespace(tenant="t", salt="s")
    h = BlockHasher(BS, fn, namespace=ns, none_hash=b"n" * 32)
    hashes: list[bytes] = []
    h.extend(hashes, list(range(9)))
    assert h.tail_key(hashes, 0) == fn((b"n" * 32, "tail", ns.keys()))
    assert h.tail_key(hashes, 2) == fn((hashes[1], "tail", None))
    assert h.tail_key(hashes, 1) not in hashes
    other = BlockHasher(BS, fn, namespace=CacheNamespace(tenant="t", salt="x"), none_hash=b"n" * 32)
    assert other.tail_key([], 0) != h.tail_key([], 0)  # the namespace is in block 0's key
    public = BlockHasher(BS, fn, namespace=ns, num_public_blocks=1, none_hash=b"n" * 32)
    plain = BlockHasher(BS, fn, none_hash=b"n" * 32)
    assert public.tail_key([], 0) == plain.tail_key([], 0)  # a public block's key carries no namespace
    assert public.tail_key(hashes[:1], 1) == fn((hashes[0], "tail", ns.keys()))


def test_a_prompt_sent_again_reuses_all_but_its_last_token() -> None:
    mgr = KVCacheManager(8, BS)
    a = make_req(mgr, "a", range(10))
    admit(mgr, a)
    finish(mgr, a)  # blocks 0, 1 cached; block 2 holds tokens 8 and 9: a partial
    again = make_req(mgr, "again", range(10))
    computed, new = admit(mgr, again)
    assert computed == ComputedBlocks([0, 1], 9, tail=TailHit(2, 1))
    assert new is not None and new[0] != 2
    assert mgr.end_pass() == [(2, new[0])]
    assert mgr.get_block_ids("again") == [0, 1, new[0]]
    release(mgr, again)


def test_the_tail_is_the_longest_shared_run_among_the_blocks_filed_there() -> None:
    mgr = KVCacheManager(16, BS)
    for rid, tokens in (
        ("x", [0, 1, 2, 3, 9, 9, 9]),
        ("y", [0, 1, 2, 3, 5, 6, 9]),
        ("z", [0, 1, 2, 3, 5, 8]),
    ):
        r = make_req(mgr, rid, tokens)
        admit(mgr, r)
        finish(mgr, r)
    # Block 1 of the new request is [5, 6, 7, 7]: y's partial shares 2 tokens, z's 1, x's none.
    q = make_req(mgr, "q", [0, 1, 2, 3, 5, 6, 7, 7])
    computed = mgr.get_computed_blocks(q)
    assert computed.tail is not None and computed.tail.num_tokens == 2
    assert mgr.block_pool.tail_tokens[computed.tail.block] == (5, 6, 9)  # y's
    # A request whose next block shares nothing with any of them gets no tail.
    none = make_req(mgr, "none", [0, 1, 2, 3, 4, 4, 4])
    assert mgr.get_computed_blocks(none) == ComputedBlocks([0], 4)
    release(mgr)


def test_a_tail_never_crosses_salts_or_tenants() -> None:
    mgr = KVCacheManager(16, BS)
    a = make_req(mgr, "a", range(10), salt="alice")
    admit(mgr, a)
    finish(mgr, a)
    for rid, salt in (("b", "bob"), ("u", None)):
        r = make_req(mgr, rid, range(10), salt=salt)
        assert mgr.get_computed_blocks(r) == ComputedBlocks([], 0), rid
    # A shorter prompt of alice's own, inside its first block: a tail of her cached block 0.
    own = make_req(mgr, "own", range(3), salt="alice")
    computed = mgr.get_computed_blocks(own)
    assert (computed.block_ids, computed.num_tokens) == ([], 2) and computed.tail is not None
    assert mgr.block_pool.tail_tokens[computed.tail.block] == (0, 1, 2, 3)
    release(mgr)


def test_forget_drops_a_tenants_partial_blocks_and_keeps_others() -> None:
    mgr = KVCacheManager(16, BS)
    ns_a, ns_b = CacheNamespace(tenant="a"), CacheNamespace(tenant="b")
    reqs = {}
    for rid, ns in (("a", ns_a), ("b", ns_b)):
        r = reqs[rid] = FakeRequest(rid, list(range(6)), mgr.make_hasher(ns, list(range(6))))
        admit(mgr, r)
        finish(mgr, r)
    assert mgr.forget(("tenant", "a")) == 2  # its full block 0 and its partial block 1
    mgr.check_invariants()
    a2 = FakeRequest("a2", list(range(6)), mgr.make_hasher(ns_a, list(range(6))))
    b2 = FakeRequest("b2", list(range(6)), mgr.make_hasher(ns_b, list(range(6))))
    assert mgr.get_computed_blocks(a2) == ComputedBlocks([], 0)
    b_hit = mgr.get_computed_blocks(b2)
    assert b_hit.num_tokens == 5 and b_hit.tail is not None
    release(mgr)


def test_a_block_cached_in_this_pass_is_no_tail_until_the_pass_ends() -> None:
    mgr = KVCacheManager(16, BS)
    a = make_req(mgr, "a", range(8))
    admit(mgr, a)  # blocks 0 and 1 are cached now, but only the coming step writes their KV
    b = make_req(mgr, "b", [0, 1, 2, 3, 4, 5, 9])
    assert mgr.get_computed_blocks(b) == ComputedBlocks([0], 4)  # block 0 by hash: written in the same step
    assert mgr.end_pass() == []
    assert mgr.get_computed_blocks(b) == ComputedBlocks([0], 6, tail=TailHit(1, 2))
    release(mgr, a)


def test_a_partial_block_is_unfiled_when_taken_and_on_reset() -> None:
    mgr = KVCacheManager(3, BS)
    a = make_req(mgr, "a", range(6))
    admit(mgr, a)
    finish(mgr, a)
    assert mgr.block_pool.tail_key[1] is not None  # a's partial block
    # Another prompt takes every block: the partial's KV is about to be overwritten, so it is unfiled.
    big = make_req(mgr, "big", range(100, 112))
    admit(mgr, big)
    finish(mgr, big)
    again = make_req(mgr, "again", range(6))
    assert mgr.get_computed_blocks(again).tail is None
    assert mgr.block_pool.num_evictions >= 1
    assert mgr.reset_prefix_cache()
    assert all(k is None for k in mgr.block_pool.tail_key)
    release(mgr)


def test_no_copy_when_the_request_is_given_the_source_block_itself() -> None:
    # Two blocks: a's partial block 1 is the only free block without a hash ahead of block 0 in the queue,
    # so the new request is given block 1 itself and the KV is already in place.
    mgr = KVCacheManager(2, BS)
    a = make_req(mgr, "a", range(6))
    admit(mgr, a)
    finish(mgr, a)
    assert free_queue(mgr.block_pool) == [1, 0]
    again = make_req(mgr, "again", range(6))
    computed, new = admit(mgr, again)
    assert computed == ComputedBlocks([0], 5, tail=TailHit(1, 1))
    assert new == [1] and mgr.end_pass() == []
    release(mgr, again)


def test_a_lookup_scans_a_bounded_number_of_blocks() -> None:
    mgr = KVCacheManager(128, BS)
    pool = mgr.block_pool
    key = b"k" * 32
    pool.add_partial(0, key, (1, 2, 3), None)  # the best match, filed first
    for b in range(1, 40):
        pool.add_partial(b, key, (1, 9), None)
    assert pool.longest_tail(key, [1, 2, 3]) == (39, 1)  # 0 is past the 32 newest
    assert pool.longest_tail(key, [1, 2, 3], scan=64) == (0, 3)
    [in_use] = pool.take(1)
    with pytest.raises(ValueError):  # only a free block can be a partial
        pool.add_partial(in_use, key, (1,), None)


def test_in_a_public_block_a_tenant_gets_no_tail_from_a_prompt_that_left_the_prefix() -> None:
    public = list(range(1, 9))  # two public blocks
    mgr = KVCacheManager(16, BS, public_prefixes=[public])
    left = FakeRequest("left", [1, 2, 3, 4, 5, 6, 0, 0], mgr.make_hasher(None, [1, 2, 3, 4, 5, 6, 0, 0]))
    admit(mgr, left)
    finish(mgr, left)  # unsalted: it left the public prefix after token 6
    prompt = [*public, 9]
    tenant = FakeRequest("t", list(prompt), mgr.make_hasher(CacheNamespace(tenant="t"), prompt))
    # Block 0 is public and cached: shared as before. Block 1's key is namespace-free too, so a tail there
    # would tell the tenant that someone's prompt went on as the prefix for 2 tokens, then elsewhere.
    hit = mgr.get_computed_blocks(tenant)
    assert (hit.num_tokens, hit.tail) == (4, None)
    unsalted = FakeRequest("u", list(prompt), mgr.make_hasher(None, prompt))
    assert mgr.get_computed_blocks(unsalted).num_tokens == 6  # the shared namespace shares all of it
    release(mgr)


def test_a_pass_made_while_a_step_runs_never_reuses_the_blocks_that_step_is_writing() -> None:
    """The engine's express passes (engine.express) run inside a step: the blocks that step's pass cached
    (`last_pass_cached`) are not computed yet, so neither a full-block hit nor a tail may come from them. After
    the step they are hits like any other."""
    mgr = KVCacheManager(16, BS)
    a = make_req(mgr, "a", range(10))  # blocks 0-1 full (cached by this pass), 2 tokens in block 2
    admit(mgr, a)
    mgr.end_pass()
    in_flight = mgr.last_pass_cached
    a_blocks = mgr.get_block_ids("a")
    assert in_flight == frozenset(a_blocks[:2])
    b = make_req(mgr, "b", [*range(10), 77])
    assert mgr.get_computed_blocks(b, in_flight) == ComputedBlocks([], 0, 11, 0, None)
    c = make_req(mgr, "c", [0, 1, 2, 99])  # would reuse 3 tokens of a's block 0 as a tail
    assert mgr.get_computed_blocks(c, in_flight).num_tokens == 0
    # The step is over: the same lookups hit.
    assert mgr.get_computed_blocks(b).block_ids == a_blocks[:2]
    assert mgr.get_computed_blocks(c) == ComputedBlocks([], 3, 4, 0, TailHit(a_blocks[0], 3))
    release(mgr, a)
