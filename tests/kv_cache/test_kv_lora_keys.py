"""The LoRA adapter as a typed cache key: ("lora", name, fingerprint) in the first private block.

An adapter's blocks are never the base model's, another adapter's, or the same name's with other weights;
no salt, tenant or gateway value can produce an adapter's key; and because an adapter changes K and V, even
the blocks of a declared public prefix are the adapter's own.
"""

from __future__ import annotations

from kv_cache import CacheNamespace, KVCacheManager

BS = 4
PUBLIC = [[9, 8, 7, 6, 5, 4, 3, 2, 1]]  # two full public blocks
FP1, FP2 = "1" * 64, "2" * 64


def hashes(mgr: KVCacheManager, ns: CacheNamespace | None, tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    hasher = mgr.make_hasher(ns, tokens)
    assert hasher is not None
    hasher.extend(out, tokens)
    return out


def test_the_adapter_key_is_typed_and_last():
    ns = CacheNamespace(tenant="t", salt="s", lora=("tone", FP1))
    assert ns.keys() == (("tenant", "t"), ("cache_salt", "s"), ("lora", "tone", FP1))
    assert "tone" not in repr(ns) and FP1 not in repr(ns) and "lora" in repr(ns)


def test_no_other_key_collides_with_an_adapter():
    mgr = KVCacheManager(64, BS)
    tokens = list(range(12))
    lora = hashes(mgr, CacheNamespace(lora=("x", FP1)), tokens)
    others = [
        None,
        CacheNamespace(salt="x"),
        CacheNamespace(tenant="x"),
        CacheNamespace(gateway="x"),
        CacheNamespace(salt="lora"),
        CacheNamespace(salt=f"x{FP1}"),
        CacheNamespace(lora=("x", FP2)),  # the same name, reloaded with other weights
        CacheNamespace(lora=("y", FP1)),
        CacheNamespace(salt="x", lora=("x", FP1)),  # a salt still partitions inside an adapter
    ]
    for ns in others:
        assert not set(hashes(mgr, ns, tokens)) & set(lora), ns
    assert hashes(mgr, CacheNamespace(lora=("x", FP1)), tokens) == lora  # within one adapter: hits


def test_public_prefix_blocks_are_not_shared_with_an_adapter():
    mgr = KVCacheManager(64, BS, public_prefixes=PUBLIC)
    tokens = [*PUBLIC[0], 0, 1, 2]
    base = hashes(mgr, None, tokens)
    tenant = hashes(mgr, CacheNamespace(tenant="t"), tokens)
    assert base[:2] == tenant[:2]  # the public blocks, shared by namespaces without an adapter
    a = hashes(mgr, CacheNamespace(tenant="t", lora=("a", FP1)), tokens)
    b = hashes(mgr, CacheNamespace(tenant="t", lora=("b", FP1)), tokens)
    assert not set(a) & set(base) and not set(a) & set(b)
    assert hashes(mgr, CacheNamespace(tenant="u", lora=("a", FP1)), tokens)[0] != a[0]


def test_stored_blocks_name_their_adapter_in_vllms_field_and_never_the_tenant_or_salt():
    """vllm-router's LoRA-aware routing reads BlockStored's lora_name; the namespace's other keys stay out."""
    from kv_fakes import FakeRequest, admit

    from engine.kv_event_wire import event_to_wire
    from kv_cache.stats import BlockStored

    mgr = KVCacheManager(16, BS, enable_events=True)
    stored = {}
    for rid, ns in (("a", CacheNamespace(tenant="t", salt="s", lora=("tone", FP1))), ("b", None)):
        tokens = list(range(100 if ns else 200, 108 if ns else 208))
        req = FakeRequest(rid, tokens, mgr.make_hasher(ns, tokens))  # type: ignore[arg-type]
        admit(mgr, req)
        [event] = [e for e in mgr.take_events() if isinstance(e, BlockStored)]
        stored[rid] = event_to_wire(event)
    assert stored["a"]["lora_name"] == "tone" and stored["b"]["lora_name"] is None
    assert "t" not in stored["a"].values() and "s" not in stored["a"].values() and FP1 not in str(stored["a"])
