"""The tier interface behind the pool, without torch: the LRU index, the host tier, and the manager's loads
(a lookup that misses the pool but hits a tier reserves blocks and waits; the blocks that arrive are cached
and count as hits of that tier), pins for writes, and a request that finishes while loading."""

from __future__ import annotations

from collections.abc import Sequence

import pytest
from kv_fakes import admit, make_req, release

from kv_cache import KVCacheManager
from kv_cache.hashing import BlockHash
from kv_cache.tiers import HostTier, TierBlock, TierEntry, TierIndex

BS = 4


class DictTiers:
    """A TierLookup over one host tier (what engine.kv_tiers.KVTiers is, minus the threads and pages)."""

    def __init__(self, capacity: int = 10**6) -> None:
        self.host = HostTier(capacity)

    def find(self, hashes: Sequence[BlockHash]) -> list[str]:
        out = []
        for h in hashes:
            if not self.host.contains(h):
                break
            out.append("host")
        return out

    def contains(self, block_hash: BlockHash) -> bool:
        return self.host.contains(block_hash)


def test_index_evicts_least_recently_used_and_forgets_by_owner() -> None:
    idx = TierIndex(30)
    assert idx.add(b"a", TierEntry(10, ("tenant", "x"))) == []
    assert idx.add(b"b", TierEntry(10, None)) == []
    assert idx.add(b"c", TierEntry(10, ("tenant", "x"))) == []
    idx.touch(b"a")
    assert idx.add(b"d", TierEntry(10, None)) == [b"b"]  # b is now the least recently used
    assert set(idx.forget(("tenant", "x"))) == {b"a", b"c"}
    assert list(idx.entries) == [b"d"]
    assert idx.add(b"huge", TierEntry(31, None)) == [b"huge"]  # larger than the tier: never stored
    idx.check_invariants()


def test_index_keeps_retained_entries_past_unretained_ones() -> None:
    idx = TierIndex(20)
    idx.add(b"kept", TierEntry(10, None, retain_until=100.0))
    idx.add(b"plain", TierEntry(10, None))
    assert idx.add(b"new", TierEntry(10, None), now=50.0) == [b"plain"]
    assert idx.add(b"newer", TierEntry(10, None), now=150.0) == [b"kept"]  # expired: oldest goes


def test_host_tier_round_trip_bound_and_stale_puts() -> None:
    host = HostTier(8)
    blk = TierBlock(0, b"h1", (), None)
    host.put(blk, b"1234", host.epoch)
    assert host.get(blk) == b"1234"
    stale = host.epoch
    host.clear()
    host.put(TierBlock(0, b"h2", (), None), b"5678", stale)  # queued before the reset: dropped
    assert not host.contains(b"h2")
    host.put(TierBlock(0, b"h3", (), None), b"123456789", host.epoch)  # larger than the tier
    assert not host.contains(b"h3")
    host.check_invariants()


def _cache_in_tier(mgr: KVCacheManager, tiers: DictTiers, tokens: list[int], salt: str | None = None) -> None:
    """Compute a request, copy its cached blocks to the tier (as the engine's writer does), then evict it
    from the pool by resetting the pool only."""
    req = make_req(mgr, "writer", tokens, salt)
    admit(mgr, req)
    for tb in mgr.take_writes():
        tiers.host.put(tb, b"kv of " + tb.block_hash, tiers.host.epoch)
        mgr.unpin([tb.block_id])
    mgr.free(req)
    assert mgr.block_pool.reset()


def test_a_pool_miss_that_a_tier_holds_is_loaded_and_counted_as_its_hit() -> None:
    mgr = KVCacheManager(16, BS)
    tiers = DictTiers()
    mgr.attach_tiers(tiers)
    tokens = list(range(100, 113))  # 3 full blocks + 1 token
    _cache_in_tier(mgr, tiers, tokens)
    mgr.make_prefix_cache_stats()

    req = make_req(mgr, "r", tokens)
    hit = mgr.get_computed_blocks(req)
    assert hit.block_ids == [] and hit.load == ["host"] * 3 and hit.num_tokens == 12
    with pytest.raises(ValueError, match="start_load"):
        mgr.allocate_slots(req, 1, hit)
    assert mgr.start_load(req, hit)
    (plan,) = mgr.take_loads()
    assert [b.block_hash for b in plan.blocks] == req.block_hashes[:3]
    assert mgr.num_free_blocks == 16 - 3 and mgr.tier_busy
    mgr.check_invariants()
    # Two of the three arrive (the third was, say, corrupt): those two are cached, all three freed.
    assert mgr.finish_loads([("r", 2)]) == ["r"]
    assert mgr.num_free_blocks == 16 and not mgr.tier_busy
    tiers.host.clear()  # the third is gone from the tier too (a corrupt file is dropped)
    computed, new = admit(mgr, req)
    assert computed.num_tokens == 8 and new is not None
    stats = mgr.make_prefix_cache_stats()
    assert stats.hits == 8 and stats.tier_hits == {"host": 8}
    mgr.unpin([w.block_id for w in mgr.take_writes()])  # the block it computed, written back
    release(mgr, req)


def test_a_request_finished_while_loading_keeps_its_blocks_until_the_load_ends() -> None:
    mgr = KVCacheManager(16, BS)
    tiers = DictTiers()
    mgr.attach_tiers(tiers)
    tokens = list(range(9))
    _cache_in_tier(mgr, tiers, tokens)
    req = make_req(mgr, "r", tokens)
    assert mgr.start_load(req, mgr.get_computed_blocks(req))
    mgr.take_loads()
    mgr.free(req)  # aborted: the loader may still be writing into its blocks
    assert mgr.num_free_blocks == 14
    assert mgr.finish_loads([("r", 2)]) == []  # abandoned: not requeued, nothing cached
    assert mgr.num_free_blocks == 16 and mgr.num_cached_blocks == 0
    mgr.check_invariants()


def test_cached_blocks_are_pinned_until_written_and_blocks_a_tier_holds_are_not_written_again() -> None:
    mgr = KVCacheManager(8, BS)
    tiers = DictTiers()
    mgr.attach_tiers(tiers)
    req = make_req(mgr, "a", range(9))
    admit(mgr, req)
    mgr.free(req)
    assert mgr.num_free_blocks == 6  # two cached blocks still pinned for their write
    mgr.check_invariants()
    writes = mgr.take_writes()
    assert [w.block_hash for w in writes] == req.block_hashes[:2]
    for w in writes:
        tiers.host.put(w, b"x", tiers.host.epoch)
    mgr.unpin([w.block_id for w in writes])
    assert mgr.num_free_blocks == 8
    again = make_req(mgr, "b", range(9))
    admit(mgr, again)
    assert mgr.take_writes() == []  # already in the tier
    # A request whose step failed computed nothing: its blocks are unpinned, not written.
    other = make_req(mgr, "c", range(50, 59))
    admit(mgr, other)
    assert mgr.take_writes(failed=["c"]) == []
    release(mgr, again, other)


def test_tier_blocks_carry_their_namespace_and_owner() -> None:
    from kv_fakes import FakeRequest

    from kv_cache import CacheNamespace

    mgr = KVCacheManager(8, BS, public_prefixes=[list(range(4))])
    mgr.attach_tiers(DictTiers())
    ns = CacheNamespace(tenant="t1", salt="s")
    tokens = list(range(9))
    req = FakeRequest("a", tokens, mgr.make_hasher(ns, tokens))
    admit(mgr, req)
    w0, w1 = mgr.take_writes()
    assert w0.namespace == () and w0.owner is None  # the public block
    assert w1.namespace == ns.keys() and w1.owner == ("tenant", "t1")
    mgr.unpin([w0.block_id, w1.block_id])
    release(mgr, req)


def test_a_reset_during_a_load_caches_nothing_it_brings() -> None:
    mgr = KVCacheManager(16, BS)
    tiers = DictTiers()
    mgr.attach_tiers(tiers)
    tokens = list(range(9))
    _cache_in_tier(mgr, tiers, tokens)
    req = make_req(mgr, "r", tokens)
    assert mgr.start_load(req, mgr.get_computed_blocks(req))
    mgr.take_loads()
    assert mgr.reset_prefix_cache(force=True)  # read before the reset: must not come back after it
    assert mgr.finish_loads([("r", 2)]) == ["r"]
    assert mgr.num_cached_blocks == 0 and mgr.num_free_blocks == 16
    mgr.check_invariants()


def test_a_whole_lookup_never_loads_the_last_tokens_block() -> None:
    """Kept logits are worth a hit in the pool only: where the tier holds every block of a request whose
    length is a multiple of the block size, the load leaves the last block (and its last token) to compute."""
    mgr = KVCacheManager(16, BS)
    tiers = DictTiers()
    mgr.attach_tiers(tiers)
    tokens = list(range(100, 112))  # 3 full blocks
    _cache_in_tier(mgr, tiers, tokens)
    req = make_req(mgr, "r", tokens)
    plain = mgr.get_computed_blocks(req)
    whole = mgr.get_computed_blocks(req, whole=True)
    assert plain.load == whole.load == ["host"] * 2 and whole.num_tokens == plain.num_tokens == 8
    release(mgr)
