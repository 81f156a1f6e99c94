"""A tenant's reset of the caches keyed by namespace (tokenizer pieces, compiled grammars) costs that tenant's
own entries: both keep an index by owner, as the KV block pool does (issue 28 section 5), instead of asking
every entry's namespace whose it is under the lock that every tokenization or compile waits for. Counted,
not timed: a namespace that counts how often its owner is asked for."""

from __future__ import annotations

import random
from array import array

import xgrammar as xgr

from engine.piece_cache import PieceCache
from engine.structured_output import GrammarCompiler
from engine.structured_spec import StructuredOutputSpec
from kv_cache.namespace import CacheNamespace, Owner

ASKED = [0]  # how often a CountingNamespace's owner was asked for


class CountingNamespace(CacheNamespace):
    __slots__ = ()

    @property
    def owner(self) -> Owner | None:
        ASKED[0] += 1
        return CacheNamespace.owner.fget(self)  # type: ignore[attr-defined]


def test_a_tenants_piece_reset_never_looks_at_another_tenants_pieces() -> None:
    cache = PieceCache()
    big, small = CountingNamespace(tenant="big"), CacheNamespace(tenant="small")
    ids = array("i", [1, 2])
    cache.store(big, [f"piece {i}" for i in range(2000)], [ids] * 2000)
    cache.store(small, ["mine", "also mine"], [ids, ids])
    cache.store(None, ["shared"], [ids])
    ASKED[0] = 0
    cache.forget(("tenant", "small"))
    assert ASKED[0] == 0  # the scan asked each of big's 2,000 pieces whose it was
    assert len(cache) == 2001 and cache.lookup(small, ["mine"]) == [None]
    assert cache.lookup(big, ["piece 7"]) == [ids] and cache.lookup(None, ["shared"]) == [ids]
    cache.check_invariants()
    cache.forget(("tenant", "big"))
    assert len(cache) == 1 and cache.chars == len("shared")
    cache.check_invariants()


def test_the_piece_index_follows_stores_evictions_and_resets() -> None:
    rng = random.Random(0)
    owners = [CacheNamespace(tenant="a"), CacheNamespace(tenant="a", salt="s"), CacheNamespace(gateway="g")]
    spaces: list[CacheNamespace | None] = [*owners, CacheNamespace(salt="only"), None]
    cache = PieceCache(max_chars=60)
    for _ in range(500):
        ns = rng.choice(spaces)
        if rng.random() < 0.1:
            cache.forget(rng.choice([("tenant", "a"), ("gateway", "g"), ("tenant", "nobody"), None]))
        else:
            pieces = [f"p{rng.randrange(30)}" * rng.randrange(1, 4) for _ in range(rng.randrange(1, 4))]
            cache.store(ns, pieces, [array("i", [1])] * len(pieces))
        cache.check_invariants()
        assert cache.chars <= cache.max_chars


def _info() -> xgr.TokenizerInfo:
    vocab = ["<eos>", "a", "b", "x", "y"]
    return xgr.TokenizerInfo(vocab, vocab_type=xgr.VocabType.RAW, vocab_size=8, stop_token_ids=[0])


def test_a_tenants_grammar_reset_never_looks_at_another_tenants_grammars() -> None:
    compiler = GrammarCompiler(_info())
    big, small = CountingNamespace(tenant="big"), CacheNamespace(tenant="small")
    specs = [StructuredOutputSpec("regex", f"[ab]{{{i}}}") for i in range(1, 41)]
    for spec in specs:
        compiler.compile(spec, big)
    compiler.compile(specs[0], small)
    ASKED[0] = 0
    compiler.forget(("tenant", "small"))
    assert ASKED[0] == 0
    assert compiler.cached(specs[0], small) is None and compiler.cached(specs[0], big) is not None
    assert len(compiler) == 40
    compiler.check_invariants()
    compiler.forget(("tenant", "big"))
    assert len(compiler) == 0 and compiler.bytes_used == 0
    compiler.check_invariants()


def test_the_grammar_index_follows_evictions() -> None:
    probe = GrammarCompiler(_info())
    size = probe.compile(StructuredOutputSpec("regex", "[xy]+")).memory_bytes
    compiler = GrammarCompiler(_info(), cache_bytes=size * 3)
    for i in range(12):
        compiler.compile(StructuredOutputSpec("regex", "[xy]+"), CacheNamespace(tenant=f"t{i % 4}"))
        compiler.check_invariants()
    assert len(compiler) <= 3
    compiler.forget(("tenant", "t3"))
    compiler.check_invariants()
