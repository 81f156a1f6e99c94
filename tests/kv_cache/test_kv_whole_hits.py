"""A whole hit (`get_computed_blocks(..., whole=True)`): where the engine kept the logits after a sequence's last
token (engine.kept_logits), the lookup may reuse that token's KV too, from a full block or a tail; and
`sequence_key`, the key those logits are kept under, names the tokens and the namespace exactly."""

from __future__ import annotations

import pytest
from kv_fakes import FakeRequest, make_req, release

from kv_cache import CacheNamespace, ComputedBlocks, KVCacheManager, TailHit

BS = 4


def run_and_free(mgr: KVCacheManager, req: FakeRequest) -> None:
    """It computed all its tokens in one step, then finished."""
    computed = mgr.get_computed_blocks(req)
    n = req.num_tokens - computed.num_tokens
    assert mgr.allocate_slots(req, n, computed) is not None
    req.num_computed_tokens = req.num_tokens
    mgr.end_pass()
    mgr.free(req)
    mgr.check_invariants()


def test_a_whole_hit_reuses_the_last_token_of_a_partial_block() -> None:
    mgr = KVCacheManager(8, BS)
    run_and_free(mgr, make_req(mgr, "a", range(10)))  # blocks 0, 1 cached; block 2 holds tokens 8, 9
    again = make_req(mgr, "again", range(10))
    assert mgr.get_computed_blocks(again) == ComputedBlocks([0, 1], 9, tail=TailHit(2, 1))
    whole = mgr.get_computed_blocks(again, whole=True)
    assert whole == ComputedBlocks([0, 1], 10, tail=TailHit(2, 2))
    new = mgr.allocate_slots(again, 0, whole)  # nothing to compute: one block, copied from the tail
    assert new is not None and len(new) == 1 and new[0] != 2
    assert mgr.end_pass() == [(2, new[0])]
    again.num_computed_tokens = 10
    release(mgr, again)


def test_a_whole_hit_reuses_the_last_full_block() -> None:
    mgr = KVCacheManager(8, BS)
    run_and_free(mgr, make_req(mgr, "a", range(8)))
    again = make_req(mgr, "again", range(8))
    assert mgr.get_computed_blocks(again) == ComputedBlocks([0], 7, tail=TailHit(1, 3))
    whole = mgr.get_computed_blocks(again, whole=True)
    assert whole == ComputedBlocks([0, 1], 8)
    assert mgr.allocate_slots(again, 0, whole) == []  # the next token takes a new block
    again.num_computed_tokens = 8
    release(mgr, again)


@pytest.mark.parametrize("n", [8, 10])
def test_a_whole_lookup_falls_back_to_all_but_the_last_token(n: int) -> None:
    """Where the last token's KV is nowhere, the hit is the plain one: the last token is computed."""
    mgr = KVCacheManager(8, BS)
    run_and_free(mgr, make_req(mgr, "a", list(range(n - 1)) + [99]))
    other = make_req(mgr, "other", range(n))
    assert mgr.get_computed_blocks(other, whole=True) == mgr.get_computed_blocks(other)
    assert mgr.get_computed_blocks(other).num_tokens == n - 1
    release(mgr)


def test_a_whole_hit_never_crosses_salts() -> None:
    mgr = KVCacheManager(8, BS)
    run_and_free(mgr, make_req(mgr, "a", range(10), salt="x"))
    assert mgr.get_computed_blocks(make_req(mgr, "b", range(10), salt="y"), whole=True).num_tokens == 0
    assert mgr.get_computed_blocks(make_req(mgr, "c", range(10), salt="x"), whole=True).num_tokens == 10
    release(mgr)


def test_the_sequence_key_names_the_tokens_and_the_namespace() -> None:
    mgr = KVCacheManager(8, BS)
    key = mgr.sequence_key
    a = key(make_req(mgr, "a", range(10)))
    assert a is not None and a == key(make_req(mgr, "a2", range(10)))
    assert a[1] is None  # no tenant: nobody's
    assert a != key(make_req(mgr, "b", range(9)))  # a prefix
    assert a != key(make_req(mgr, "c", [*range(9), 7]))  # the last token
    assert a != key(make_req(mgr, "d", [5, *range(1, 10)]))  # an earlier block
    assert a != key(make_req(mgr, "e", range(10), salt="s"))
    assert key(make_req(mgr, "f", range(8))) != key(make_req(mgr, "g", range(9)))  # a full last block
    tenant = CacheNamespace(tenant="t")
    t = key(FakeRequest("t", list(range(10)), mgr.make_hasher(tenant, list(range(10)))))
    assert t is not None and t[1] == ("tenant", "t") and t[0] != a[0]
    # Grown by a generated token, the request's key follows it.
    grown = make_req(mgr, "h", range(9))
    grown.append(9)
    assert key(grown) == a
    off = KVCacheManager(8, BS, enable_caching=False)
    assert off.sequence_key(make_req(off, "i", range(4))) is None
    assert off.sequence_key(make_req(mgr, "j", range(4))) is None  # even with a hasher from elsewhere


def test_a_sequence_inside_a_public_prefix_is_still_its_namespaces() -> None:
    """Its blocks are shared, but whether someone sent exactly the public text and nothing after it is not."""
    mgr = KVCacheManager(8, BS, public_prefixes=[list(range(8))])
    key = mgr.sequence_key
    alice, bob = CacheNamespace(tenant="alice"), CacheNamespace(tenant="bob")
    a = key(FakeRequest("a", list(range(8)), mgr.make_hasher(alice, list(range(8)))))
    b = key(FakeRequest("b", list(range(8)), mgr.make_hasher(bob, list(range(8)))))
    plain = key(FakeRequest("c", list(range(8)), mgr.make_hasher(None, list(range(8)))))
    assert a is not None and b is not None and plain is not None
    assert len({a[0], b[0], plain[0]}) == 3
    assert a[1] == ("tenant", "alice") and b[1] == ("tenant", "bob") and plain[1] is None
