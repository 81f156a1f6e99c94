"""A tenant's reset (`forget(owner)`) costs that tenant's blocks, not the pool's (issue 28, section 5): any
tenant may send one, and it runs under the engine's core lock, so a scan of every block would let one tenant
stall every step. Counted, not timed: the pool's per-block owner list is swapped for one that counts reads."""

from __future__ import annotations

from kv_fakes import FakeRequest, admit, release

from kv_cache import CacheNamespace, KVCacheManager

BS = 4
NUM_BLOCKS = 20_000


class CountingList(list):
    """A list that counts the items read from it, one by one or by iterating."""

    reads = 0

    def __iter__(self):
        self.reads += len(self)
        return super().__iter__()

    def __getitem__(self, i):
        self.reads += 1
        return super().__getitem__(i)


def test_forget_reads_only_the_owners_blocks_of_a_large_pool() -> None:
    mgr = KVCacheManager(NUM_BLOCKS, BS)
    prompt = list(range(1, 4 * BS + 3))  # 4 full blocks and a partial one
    a1 = FakeRequest("a1", list(prompt), mgr.make_hasher(CacheNamespace(tenant="a"), prompt))
    a2 = FakeRequest("a2", list(prompt), mgr.make_hasher(CacheNamespace(tenant="a", salt="s"), prompt))
    b = FakeRequest("b", list(prompt), mgr.make_hasher(CacheNamespace(tenant="b"), prompt))
    for r in (a1, a2, b):
        admit(mgr, r)
    mgr.free(a2)  # a2's full blocks stay cached, its last block becomes a partial; a1 runs on
    counting = CountingList(mgr.block_pool.block_owner)
    mgr.block_pool.block_owner = counting
    forgotten = mgr.forget(("tenant", "a"))
    assert forgotten == 4 + 4 + 1  # a1's and a2's full blocks, and a2's partial block
    # Each forgotten block's owner is read a bounded number of times; never the other 19,990 blocks.
    assert counting.reads <= 4 * forgotten, counting.reads
    mgr.check_invariants()
    assert mgr.forget(("tenant", "a")) == 0
    assert mgr.forget(("tenant", "b")) == 4
    mgr.check_invariants()
    release(mgr, a1, b)


def test_the_owner_index_follows_eviction_and_reset() -> None:
    mgr = KVCacheManager(6, BS)  # tiny: the second tenant's prompt evicts the first's blocks
    prompt = list(range(1, 4 * BS + 1))
    a = FakeRequest("a", list(prompt), mgr.make_hasher(CacheNamespace(tenant="a"), prompt))
    admit(mgr, a)
    release(mgr, a)
    other = [p + 100 for p in prompt]
    b = FakeRequest("b", list(other), mgr.make_hasher(CacheNamespace(tenant="b"), other))
    admit(mgr, b)
    mgr.check_invariants()  # the index dropped the evicted blocks of a
    left = sum(1 for o in mgr.block_pool.block_owner if o == ("tenant", "a"))
    assert 0 < left < 4  # b's prompt evicted some of a's blocks, not all
    assert mgr.forget(("tenant", "a")) == left
    release(mgr, b)
    assert mgr.reset_prefix_cache()
    mgr.check_invariants()
    assert mgr.forget(("tenant", "b")) == 0


def test_a_forced_reset_drops_every_hash_and_the_blocks_in_use_keep_serving() -> None:
    mgr = KVCacheManager(64, BS, enable_events=True)
    prompt = list(range(1, 3 * BS + 2))
    running = FakeRequest("run", list(prompt), mgr.make_hasher(None, prompt))
    done = FakeRequest("done", [p + 50 for p in prompt], mgr.make_hasher(None, [p + 50 for p in prompt]))
    admit(mgr, running)
    admit(mgr, done)
    mgr.free(done)
    assert not mgr.reset_prefix_cache()  # in use: refused unless forced
    mgr.take_events()
    assert mgr.reset_prefix_cache(force=True)
    mgr.check_invariants()
    assert mgr.num_cached_blocks == 0
    assert [type(e).__name__ for e in mgr.take_events()] == ["AllBlocksCleared"]
    again = FakeRequest("again", list(prompt), mgr.make_hasher(None, prompt))
    assert mgr.get_computed_blocks(again).num_tokens == 0  # nothing of the running prompt is findable
    running.append(*range(100, 100 + BS))  # it goes on: its next full block is cached as usual
    assert mgr.allocate_slots(running, BS) is not None
    running.num_computed_tokens += BS
    mgr.check_invariants()
    release(mgr, running)
