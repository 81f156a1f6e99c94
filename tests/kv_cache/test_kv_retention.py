"""Retention: a retained prompt's blocks are not evicted for their TTL (each hit refreshing it), the global
cap and each holder's share hold (a tenant's salts and adapters count as one holder), a holder past its share
yields its own least recently used prompt's deepest blocks (so the leading blocks stay reachable), and resets
release."""

from __future__ import annotations

from dataclasses import dataclass

from kv_fakes import FakeRequest, admit, release

from kv_cache import CacheNamespace, KVCacheManager

BS = 4


@dataclass
class RetainingRequest(FakeRequest):
    ttl: float = 0.0
    retain_tokens: int = 0

    @property
    def retention(self) -> tuple[float, int] | None:
        return (self.ttl, self.retain_tokens) if self.ttl else None


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def make(num_blocks: int = 16, fraction: float = 0.5) -> tuple[KVCacheManager, Clock]:
    mgr = KVCacheManager(num_blocks, BS, max_retained_fraction=fraction)
    clock = Clock()
    mgr.clock = clock
    return mgr, clock


def req(mgr: KVCacheManager, rid: str, tokens, salt: str = "s", ttl: float = 0.0, upto: int | None = None):
    tokens = list(tokens)
    ns = CacheNamespace(salt=salt)
    return RetainingRequest(
        rid, tokens, mgr.make_hasher(ns, tokens), ttl=ttl, retain_tokens=upto or len(tokens)
    )


def flood(mgr: KVCacheManager, n: int, salt: str = "flood") -> None:
    """Prompts that need every free block, one after another: evicts whatever is not retained."""
    for i in range(n):
        r = req(mgr, f"flood{i}", range(1000 * (i + 1), 1000 * (i + 1) + BS * mgr.num_free_blocks), salt)
        admit(mgr, r)
        mgr.end_pass()
        mgr.free(r)


def test_a_retained_prompt_survives_a_flood_and_an_unretained_one_does_not() -> None:
    mgr, clock = make()
    kept = req(mgr, "kept", range(13), ttl=300)  # 3 full blocks
    plain = req(mgr, "plain", range(100, 113), salt="t")
    for r in (kept, plain):
        admit(mgr, r)
        mgr.free(r)
    assert len(mgr.retention) == 3
    flood(mgr, 3)
    assert admit(mgr, again := req(mgr, "k2", range(13)))[0].num_tokens == 12
    assert admit(mgr, other := req(mgr, "p2", range(100, 113), salt="t"))[0].num_tokens == 0
    mgr.free(again)
    mgr.free(other)
    mgr.check_invariants()
    clock.now = 301 + 300  # the hit at t=0 refreshed it; past that TTL it goes
    mgr.end_pass()
    assert len(mgr.retention) == 0 and mgr.retention.num_expiries == 3
    stats = mgr.make_prefix_cache_stats()
    assert stats.retention_expiries == 3 and stats.retained_blocks == 0
    release(mgr)


def test_a_hit_refreshes_the_ttl() -> None:
    mgr, clock = make()
    r = req(mgr, "a", range(9), ttl=10)
    admit(mgr, r)
    mgr.free(r)
    clock.now = 8
    hit = req(mgr, "b", range(9))  # no retention of its own
    admit(mgr, hit)
    mgr.free(hit)
    clock.now = 15  # 15 > 10, but the hit at 8 keeps it until 18
    mgr.end_pass()
    assert len(mgr.retention) == 2
    clock.now = 18.5
    mgr.end_pass()
    assert len(mgr.retention) == 0
    release(mgr)


def test_only_the_blocks_up_to_the_breakpoint_are_retained() -> None:
    mgr, _ = make()
    r = req(mgr, "a", range(17), ttl=60, upto=9)  # a breakpoint after token 9: blocks 0 and 1
    admit(mgr, r)
    mgr.free(r)
    assert len(mgr.retention) == 2
    mgr.reset_prefix_cache()
    assert len(mgr.retention) == 0
    release(mgr)


def test_the_global_cap_and_each_namespace_share_hold() -> None:
    mgr, _ = make(num_blocks=16, fraction=0.5)  # cap 8
    a = req(mgr, "a", range(33), salt="A", ttl=60)  # 8 full blocks: alone, A may take the whole cap
    _, a_blocks = admit(mgr, a)
    mgr.free(a)
    assert mgr.retention.count(CacheNamespace(salt="A").holder) == 8
    b = req(mgr, "b", range(500, 517), salt="B", ttl=60)  # B arrives: the share is now 4 each
    admit(mgr, b)
    mgr.free(b)
    assert len(mgr.retention) <= 8
    assert mgr.retention.count(CacheNamespace(salt="B").holder) == 4
    assert mgr.retention.count(CacheNamespace(salt="A").holder) == 4
    # A's deepest blocks yielded: its leading 4 are the ones still kept (reachable by a hit).
    assert a_blocks is not None and [b in mgr.retention for b in a_blocks[:8]] == [True] * 4 + [False] * 4
    c = req(mgr, "c", range(900, 917), salt="A", ttl=60)  # A at its share: only its own go
    admit(mgr, c)
    mgr.free(c)
    assert mgr.retention.count(CacheNamespace(salt="B").holder) == 4
    assert mgr.retention.count(CacheNamespace(salt="A").holder) == 4
    mgr.check_invariants()
    mgr.reset_prefix_cache()
    release(mgr)


def test_a_tenant_reset_releases_its_retained_blocks() -> None:
    mgr, _ = make()
    tokens = list(range(9))
    ns = CacheNamespace(tenant="t1")
    r = RetainingRequest("a", tokens, mgr.make_hasher(ns, tokens), ttl=60, retain_tokens=9)
    admit(mgr, r)
    mgr.free(r)
    assert len(mgr.retention) == 2
    mgr.forget(("tenant", "t1"))
    assert len(mgr.retention) == 0
    release(mgr)


def test_no_retention_without_caching_or_with_a_zero_cap() -> None:
    mgr, _ = make(fraction=0.0)
    r = req(mgr, "a", range(9), ttl=60)
    admit(mgr, r)
    mgr.free(r)
    assert len(mgr.retention) == 0
    release(mgr)


def test_retention_yields_when_nothing_else_could_free_a_block() -> None:
    mgr, _ = make(num_blocks=16, fraction=0.5)
    kept = req(mgr, "a", range(33), ttl=600)  # 8 retained: half the pool
    admit(mgr, kept)
    mgr.free(kept)
    big = req(mgr, "big", range(100, 152), salt="t")  # needs 13 blocks: only 8 are free
    computed, new = admit(mgr, big)
    assert new is not None and len(mgr.retention) == 3  # five yielded, the rest still kept
    mgr.free(big)
    mgr.reset_prefix_cache()
    release(mgr)


def _hits(mgr: KVCacheManager, rid: str, tokens, salt: str = "s", ns: CacheNamespace | None = None) -> int:
    """Tokens a fresh request for `tokens` finds cached (then released)."""
    tokens = list(tokens)
    r = RetainingRequest(rid, tokens, mgr.make_hasher(ns or CacheNamespace(salt=salt), tokens))
    computed, _ = admit(mgr, r)
    mgr.end_pass()
    mgr.free(r)
    return computed.num_tokens


def test_a_prompt_longer_than_the_cap_keeps_its_leading_blocks() -> None:
    """Once, the prompt's first blocks yielded to its later ones: after a flood the prompt found 0 tokens cached
    while its deepest blocks stayed retained, unreachable (a probe: 2 of 891 tokens cached, 44 blocks held)."""
    mgr, _ = make(num_blocks=16, fraction=0.5)  # cap 8
    long = req(mgr, "long", range(49), ttl=60)  # 12 full blocks
    admit(mgr, long)
    mgr.free(long)
    assert len(mgr.retention) == 8
    flood(mgr, 3)
    assert _hits(mgr, "again", range(49)) == 8 * BS  # the leading 8 blocks
    mgr.check_invariants()
    mgr.reset_prefix_cache()
    release(mgr)


def test_a_holder_that_yields_keeps_its_prompts_reachable() -> None:
    """B retains 6 blocks alone; A's arrival halves the share and B yields 2: B's deepest, so that B's prompt
    still hits its first 4 blocks after a flood (once its first blocks yielded, and it hit nothing)."""
    mgr, _ = make(num_blocks=16, fraction=0.5)  # cap 8
    b = req(mgr, "b", range(25), salt="B", ttl=60)  # 6 blocks
    admit(mgr, b)
    mgr.free(b)
    a = req(mgr, "a", range(500, 517), salt="A", ttl=60)  # 4 blocks: the share is now 4 each
    admit(mgr, a)
    mgr.free(a)
    assert mgr.retention.count(CacheNamespace(salt="B").holder) == 4
    flood(mgr, 3)
    assert _hits(mgr, "b2", range(25), salt="B") == 4 * BS
    assert _hits(mgr, "a2", range(500, 517), salt="A") == 4 * BS
    mgr.reset_prefix_cache()
    release(mgr)


def test_the_least_recently_used_prompt_of_a_holder_yields_first() -> None:
    mgr, clock = make(num_blocks=32, fraction=0.25)  # cap 8
    old = req(mgr, "old", range(17), ttl=60)  # 4 blocks
    new = req(mgr, "new", range(100, 117), ttl=60)  # 4 blocks
    for r in (old, new):
        admit(mgr, r)
        mgr.free(r)
    clock.now = 1
    assert _hits(mgr, "use-old", range(17)) == 16  # a hit makes "old" the most recently used
    third = req(mgr, "third", range(200, 209), ttl=60)  # 2 blocks: "new" yields its 2 deepest
    admit(mgr, third)
    mgr.free(third)
    flood(mgr, 3)
    assert _hits(mgr, "old2", range(17)) == 16
    assert _hits(mgr, "new2", range(100, 117)) == 2 * BS
    assert _hits(mgr, "third2", range(200, 209)) == 2 * BS
    mgr.reset_prefix_cache()
    release(mgr)


def test_a_tenants_salts_and_adapters_share_one_holders_share() -> None:
    """A tenant rotating salts (or adapters) used to get a share per salt and push every other tenant's
    retained prompts out (a probe: 4 salts, and the other tenant's prompt found 0 of 324 tokens cached)."""
    mgr, _ = make(num_blocks=64, fraction=0.25)  # cap 16

    def tenant_req(rid: str, tokens, tenant: str, salt: str | None = None, lora=None):
        ns = CacheNamespace(tenant=tenant, salt=salt, lora=lora)
        tokens = list(tokens)
        return RetainingRequest(rid, tokens, mgr.make_hasher(ns, tokens), ttl=60, retain_tokens=len(tokens))

    victim = tenant_req("v", range(33), "B")  # 8 blocks
    admit(mgr, victim)
    mgr.free(victim)
    for i, (salt, lora) in enumerate((("s0", None), ("s1", None), ("s2", ("ad", "f")), (None, ("ad2", "g")))):
        r = tenant_req(f"a{i}", range(1000 * (i + 1), 1000 * (i + 1) + 33), "A", salt, lora)
        admit(mgr, r)
        mgr.free(r)
    assert mgr.retention.count(("tenant", "B")) == 8 and mgr.retention.count(("tenant", "A")) == 8
    flood(mgr, 3)
    assert _hits(mgr, "v2", range(33), ns=CacheNamespace(tenant="B")) == 32
    mgr.check_invariants()
    mgr.reset_prefix_cache()
    release(mgr)
