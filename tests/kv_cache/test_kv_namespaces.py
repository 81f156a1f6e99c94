"""Cache namespaces and public prefixes at the hash and manager level.

Properties (hypothesis): across two namespaces, a block hash is shared only when the block lies wholly inside a
declared public prefix (never a block outside one), and always when both prompts start with that prefix
(every block inside it). The unsalted namespace hashes every block without a key, so its blocks equal the
public ones where their tokens do: still only public tokens. Plus: the typed keys never collide across kinds, the longest public prefix wins, public hits
are counted, and forget(owner) drops exactly one tenant's private blocks.
"""

from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st
from kv_fakes import FakeRequest, admit, release

from kv_cache import BlockRemoved, CacheNamespace, KVCacheManager, PublicPrefixes
from kv_cache.hashing import BlockHasher, get_hash_fn

BS = 4
SEED = b"\x01" * 32
# Two public prefixes, one extending the other, both not block-aligned: boundary blocks straddle.
PUBLIC = [[9, 8, 7, 6, 5, 4, 3], [9, 8, 7, 6, 5, 4, 3, 2, 1, 0, 9, 8, 7, 6]]
NAMESPACES = [
    None,
    CacheNamespace(salt="a"),
    CacheNamespace(tenant="a"),
    CacheNamespace(gateway="a"),
    CacheNamespace(tenant="a", salt="a"),
    CacheNamespace(tenant="b", salt="a"),
    CacheNamespace(tenant="b"),
]
namespaces = st.sampled_from(NAMESPACES)
# Prompts that often start with a public prefix, in part or whole, then continue with a small vocabulary.
prompts = st.builds(
    lambda head, n, tail: head[:n] + tail,
    st.sampled_from([[], *PUBLIC]),
    st.integers(0, 14),
    st.lists(st.integers(0, 9), max_size=12),
).filter(bool)


def mgr_with_public() -> KVCacheManager:
    return KVCacheManager(64, BS, public_prefixes=PUBLIC)


def hashes(mgr: KVCacheManager, ns: CacheNamespace | None, tokens: list[int]) -> list[bytes]:
    out: list[bytes] = []
    hasher = mgr.make_hasher(ns, tokens)
    assert hasher is not None
    hasher.extend(out, tokens)
    return out


def public_len(tokens: list[int]) -> int:
    """The reference: the longest declared prefix the tokens start with."""
    return max((len(p) for p in PUBLIC if tokens[: len(p)] == p), default=0)


@settings(max_examples=300, deadline=None)
@given(ns1=namespaces, ns2=namespaces, t1=prompts, t2=prompts)
def test_only_blocks_inside_a_public_prefix_are_shared_across_namespaces(
    ns1: CacheNamespace | None, ns2: CacheNamespace | None, t1: list[int], t2: list[int]
) -> None:
    mgr = mgr_with_public()
    h1, h2 = hashes(mgr, ns1, t1), hashes(mgr, ns2, t2)
    if ns1 == ns2:
        return  # one namespace shares whatever it computes: not what this property is about
    p1, p2 = public_len(t1) // BS, public_len(t2) // BS

    def unkeyed(ns: CacheNamespace | None, i: int, public_blocks: int) -> bool:
        """Block i and its parents carry no namespace key: inside the public prefix, or no namespace at all."""
        return i < public_blocks or ns is None or not ns.keys()

    for i in range(min(len(h1), len(h2))):
        same_tokens = t1[: (i + 1) * BS] == t2[: (i + 1) * BS]
        shared = h1[i] == h2[i]
        assert shared == (same_tokens and unkeyed(ns1, i, p1) and unkeyed(ns2, i, p2)), (i, ns1, ns2, t1, t2)
        if shared:  # the invariant: only tokens of a declared public prefix, at their positions in it
            assert any(len(p) >= (i + 1) * BS and p[: (i + 1) * BS] == t1[: (i + 1) * BS] for p in PUBLIC)
        if same_tokens and i < p1 and i < p2:  # blocks wholly inside a public prefix are always shared
            assert shared
    # No hash of one appears anywhere in the other but at the same position.
    for h in set(h1) & set(h2):
        assert h1.index(h) == h2.index(h)


@settings(max_examples=150, deadline=None)
@given(
    ns_a=namespaces, ns_b=namespaces, tail_a=st.lists(st.integers(0, 9), max_size=10), which=st.integers(0, 1)
)
def test_another_namespace_hits_exactly_the_public_full_blocks(
    ns_a: CacheNamespace | None, ns_b: CacheNamespace | None, tail_a: list[int], which: int
) -> None:
    """Tenant B sending tenant A's exact prompt gets exactly the public prefix's full blocks, never more."""
    if ns_a == ns_b:
        return
    mgr = mgr_with_public()
    prompt = PUBLIC[which] + tail_a
    a = FakeRequest("a", list(prompt), mgr.make_hasher(ns_a, prompt))
    admit(mgr, a)
    mgr.free(a)
    b = FakeRequest("b", list(prompt), mgr.make_hasher(ns_b, prompt))
    computed = mgr.get_computed_blocks(b)
    full_public = min(len(PUBLIC[which]) // BS, (len(prompt) - 1) // BS)
    assert computed.num_tokens == full_public * BS
    assert computed.num_public_tokens == computed.num_tokens
    release(mgr)


def test_typed_keys_go_into_the_first_private_block() -> None:
    fn = get_hash_fn("sha256")
    tokens = list(range(12))
    ns = CacheNamespace(tenant="t", salt="s")
    hasher = BlockHasher(BS, fn, namespace=ns, num_public_blocks=1, none_hash=SEED)
    assert hasher.extra_keys(0) is None
    assert hasher.extra_keys(1) == (("tenant", "t"), ("cache_salt", "s"))
    assert hasher.extra_keys(2) is None
    out: list[bytes] = []
    hasher.extend(out, tokens)
    expected = fn((SEED, tokens[0:4], None))
    assert out[0] == expected
    expected = fn((expected, tokens[4:8], (("tenant", "t"), ("cache_salt", "s"))))
    assert out[1] == expected
    assert out[2] == fn((expected, tokens[8:12], None))
    # Each kind's key is typed and carries its value: a gateway namespace is ("gateway", value).
    full = CacheNamespace(tenant="t", gateway="g", salt="s")
    assert full.keys() == (("tenant", "t"), ("gateway", "g"), ("cache_salt", "s"))
    assert CacheNamespace(gateway="g").keys() == (("gateway", "g"),)


def test_kinds_never_collide_and_cache_salt_shorthand_is_the_salt_namespace() -> None:
    fn = get_hash_fn("sha256")
    tokens = list(range(8))

    def h(**kw: object) -> list[bytes]:
        out: list[bytes] = []
        BlockHasher(BS, fn, none_hash=SEED, **kw).extend(out, tokens)  # type: ignore[arg-type]
        return out

    variants = [
        h(),
        h(namespace=CacheNamespace(tenant="x")),
        h(namespace=CacheNamespace(gateway="x")),
        h(namespace=CacheNamespace(salt="x")),
        h(namespace=CacheNamespace(tenant="x", salt="x")),
        h(namespace=CacheNamespace(tenant="x", gateway="x")),
    ]
    assert len({v[0] for v in variants}) == len(variants)
    assert h(cache_salt="x") == h(namespace=CacheNamespace(salt="x"))
    assert "x" not in repr(CacheNamespace(tenant="x", salt="x"))  # a repr never names anyone


def test_a_namespace_repr_names_its_kinds_never_their_values() -> None:
    assert repr(CacheNamespace()) == "CacheNamespace(unsalted)"
    assert repr(CacheNamespace(salt="s3cret")) == "CacheNamespace(salt)"
    assert repr(CacheNamespace(gateway="gw-1")) == "CacheNamespace(gateway)"
    assert (
        repr(CacheNamespace(tenant="acme", gateway="gw", salt="s")) == "CacheNamespace(tenant, gateway, salt)"
    )


def test_without_public_prefixes_no_block_is_public() -> None:
    # Block size 1: a single public token would already make block 0 public.
    mgr = KVCacheManager(8, 1)
    assert mgr.make_hasher(CacheNamespace(tenant="t"), [5, 6, 7]).num_public_blocks == 0  # type: ignore[union-attr]


def test_public_prefixes_declared_later_apply_to_later_requests() -> None:
    mgr = KVCacheManager(64, BS)
    assert mgr.make_hasher(CacheNamespace(tenant="t"), PUBLIC[1] + [1]).num_public_blocks == 0  # type: ignore[union-attr]
    mgr.set_public_prefixes(PUBLIC)
    assert mgr.make_hasher(CacheNamespace(tenant="t"), PUBLIC[1] + [1]).num_public_blocks == 3  # type: ignore[union-attr]
    mgr.set_public_prefixes([])
    assert mgr.make_hasher(CacheNamespace(tenant="t"), PUBLIC[1] + [1]).num_public_blocks == 0  # type: ignore[union-attr]


def test_longest_public_prefix_wins_and_partial_prefixes_do_not_count() -> None:
    pp = PublicPrefixes(PUBLIC)
    assert pp.match(PUBLIC[1] + [5]) == len(PUBLIC[1])
    assert pp.match(PUBLIC[0] + [5]) == len(PUBLIC[0])
    assert pp.match(PUBLIC[0][:-1]) == 0
    assert pp.match(PUBLIC[1][:10]) == len(PUBLIC[0])
    assert pp.match([]) == 0 and pp.match([1, 2]) == 0
    mgr = mgr_with_public()
    assert mgr.make_hasher(CacheNamespace(tenant="t"), PUBLIC[1] + [1]).num_public_blocks == 3  # type: ignore[union-attr]
    assert mgr.make_hasher(CacheNamespace(tenant="t"), PUBLIC[0]).num_public_blocks == 1  # type: ignore[union-attr]


def test_public_hits_are_counted_apart() -> None:
    mgr = mgr_with_public()
    prompt = PUBLIC[1] + [1, 2, 3, 4, 5]  # 19 tokens: 3 public blocks, then private ones
    a = FakeRequest("a", list(prompt), mgr.make_hasher(CacheNamespace(tenant="a"), prompt))
    admit(mgr, a)
    mgr.free(a)
    a2 = FakeRequest("a2", list(prompt), mgr.make_hasher(CacheNamespace(tenant="a"), prompt))
    b = FakeRequest("b", list(prompt), mgr.make_hasher(CacheNamespace(tenant="b"), prompt))
    mgr.make_prefix_cache_stats()
    ca, _ = admit(mgr, a2)
    cb, _ = admit(mgr, b)
    # Its own private block 3 too, and 2 of the 3 tokens of its partial block 4 (a tail: the last is computed).
    assert (ca.num_tokens, ca.num_public_tokens) == (18, 12)
    assert (cb.num_tokens, cb.num_public_tokens, cb.tail) == (12, 12, None)  # a's tail is a's alone
    stats = mgr.make_prefix_cache_stats()
    assert (stats.hits, stats.public_hits) == (30, 24)
    release(mgr, a2, b)


def test_forget_drops_one_tenants_private_blocks_only() -> None:
    mgr = KVCacheManager(64, BS, public_prefixes=PUBLIC, enable_events=True)
    prompt = PUBLIC[1] + [1, 2, 3, 4, 5, 6]  # 3 public blocks + 2 private full blocks
    reqs = {
        name: FakeRequest(name, list(prompt), mgr.make_hasher(ns, prompt))
        for name, ns in (
            ("a1", CacheNamespace(tenant="a")),
            ("a2", CacheNamespace(tenant="a", salt="user-1")),
            ("b", CacheNamespace(tenant="b")),
            ("g", CacheNamespace(gateway="a")),  # same string as tenant a, another kind: not a's
        )
    }
    for r in reqs.values():
        admit(mgr, r)
    mgr.free(reqs["a2"])  # a1 keeps running: its blocks are in use
    mgr.take_events()
    cached_before = mgr.num_cached_blocks
    assert mgr.forget(("tenant", "a")) == 4  # two private blocks each for a1 and a2
    mgr.check_invariants()
    assert mgr.num_cached_blocks == cached_before - 4
    (event,) = mgr.take_events()
    assert isinstance(event, BlockRemoved) and len(event.block_hashes) == 4
    # a's next identical request: only the public blocks; b and the gateway namespace keep theirs.
    for name, ns, hit in (
        ("a3", CacheNamespace(tenant="a"), 12),
        ("b2", CacheNamespace(tenant="b"), 16),
        ("g2", CacheNamespace(gateway="a"), 16),
    ):
        r = FakeRequest(name, list(prompt), mgr.make_hasher(ns, prompt))
        assert mgr.get_computed_blocks(r).num_tokens == hit, name
    # The running request keeps its blocks and finishes normally; then nothing leaks.
    reqs["a1"].append(7, 8)
    mgr.allocate_slots(reqs["a1"], 2)
    mgr.check_invariants()
    mgr.take_events()
    assert mgr.forget(("tenant", "nobody")) == 0
    assert mgr.take_events() == []  # forgetting nothing publishes no (empty) removal
    release(mgr, reqs["a1"], reqs["b"], reqs["g"])


def test_kv_events_never_carry_the_namespace() -> None:
    mgr = KVCacheManager(16, BS, public_prefixes=PUBLIC, enable_events=True)
    prompt = PUBLIC[1] + [1, 2, 3, 4, 5, 6]
    req = FakeRequest(
        "r", list(prompt), mgr.make_hasher(CacheNamespace(tenant="tenant-zz9", salt="salt-qq7"), prompt)
    )
    admit(mgr, req)
    mgr.forget(("tenant", "tenant-zz9"))
    events = mgr.take_events()
    assert len(events) == 2  # stored, then removed
    for event in events:
        text = repr(event).encode() + b"".join(getattr(event, "block_hashes", []))
        assert b"tenant-zz9" not in text and b"salt-qq7" not in text
    release(mgr, req)
