"""Block hashing: the chain, typed extra keys, incremental extension, algorithms and seed reproducibility."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import cbor2
import pytest
import xxhash
from hypothesis import example, given, settings
from hypothesis import strategies as st

from kv_cache import CacheNamespace
from kv_cache.hashing import HASH_ALGOS, BlockHasher, encode, get_hash_fn, init_none_hash

ROOT = Path(__file__).resolve().parents[2]
SEED = b"\x00" * 32


@pytest.mark.parametrize("algo", HASH_ALGOS)
def test_chain_definition(algo: str) -> None:
    fn = get_hash_fn(algo)
    hasher = BlockHasher(4, fn, none_hash=SEED)
    tokens = list(range(10))
    hashes: list[bytes] = []
    hasher.extend(hashes, tokens)
    h0 = fn((SEED, [0, 1, 2, 3], None))
    h1 = fn((h0, [4, 5, 6, 7], None))
    assert hashes == [h0, h1]  # the partial third block is not hashed
    assert all(isinstance(h, bytes) and len(h) == (32 if algo.startswith("sha") else 16) for h in hashes)


def test_algorithms_hash_the_documented_bytes() -> None:
    key = (SEED, [1, 2, 3], (("cache_salt", "s"),))
    assert get_hash_fn("sha256")(key) == hashlib.sha256(encode(key)).digest()
    assert get_hash_fn("sha256_cbor")(key) == hashlib.sha256(cbor2.dumps(key, canonical=True)).digest()
    assert get_hash_fn("xxhash")(key) == xxhash.xxh3_128_digest(encode(key))
    assert get_hash_fn("xxhash_cbor")(key) == xxhash.xxh3_128_digest(cbor2.dumps(key, canonical=True))
    assert len({get_hash_fn(a)(key) for a in HASH_ALGOS}) == 4
    with pytest.raises(ValueError, match="sha256"):
        get_hash_fn("md5")


def test_encode_is_injective_on_tricky_pairs() -> None:
    pairs = [
        (("ab", "c"), ("a", "bc")),
        ((1, (2,)), ((1,), 2)),
        ([1, 2], [1, 2, 0]),
        ([0], [0, 0]),
        ((), None),
        ("1", 1),
        (b"a", "a"),
        ((b"", [1]), (b"\x01", [])),
        ([2**63], [2**63 - 1]),
        ([-1], [2**64 - 1]),
        # Negative ints beyond int64 encode too (two's complement), apart from the positive one.
        ([-(2**70)], [2**70]),
        ((("cache_salt", "x"),), (("lora", "x"),)),
    ]
    for a, b in pairs:
        assert encode(a) != encode(b), (a, b)
    assert encode((1, 2)) == encode([1, 2])  # lists and tuples alike (cbor agrees)
    assert encode([2**70, 5]) == encode([2**70, 5])  # big ints take the general path, still deterministic
    with pytest.raises(TypeError):
        encode([1.5])
    with pytest.raises(TypeError):
        encode({"a": 1})


@settings(max_examples=100, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 50_000), max_size=60),
    cuts=st.lists(st.integers(0, 60), max_size=8),
    block_size=st.integers(1, 8),
)
def test_incremental_extend_equals_one_shot(tokens: list[int], cuts: list[int], block_size: int) -> None:
    calls = 0
    sha = get_hash_fn("sha256")

    def counting(obj: object) -> bytes:
        nonlocal calls
        calls += 1
        return sha(obj)

    whole: list[bytes] = []
    BlockHasher(block_size, sha, none_hash=SEED, cache_salt="t").extend(whole, tokens)
    inc: list[bytes] = []
    hasher = BlockHasher(block_size, counting, none_hash=SEED, cache_salt="t")
    for cut in [*sorted(cuts), len(tokens), len(tokens)]:
        hasher.extend(inc, tokens[: min(cut, len(tokens))])
    assert inc == whole
    assert len(whole) == len(tokens) // block_size
    assert calls == len(whole)  # every block hashed exactly once


@settings(max_examples=60, deadline=None)
@given(
    algo=st.sampled_from(HASH_ALGOS),
    tokens=st.lists(st.one_of(st.integers(0, 2**16), st.integers(-(2**70), 2**70)), max_size=24),
    salt=st.one_of(st.none(), st.text(max_size=3)),
    block_size=st.integers(1, 5),
)
# Fixed cases on the fast path, so that a mutation run always reaches them: a salted first block followed by
# unkeyed ones, and a token id beyond int64 (the general encoding inside the fast path).
@example(algo="sha256", tokens=[1, 2, 3, 4, 5, 6], salt="s", block_size=2)
@example(algo="xxhash", tokens=[1, 2, 2**70, 4, 5, 6], salt=None, block_size=2)
def test_block_hasher_matches_the_definition(
    algo: str, tokens: list[int], salt: str | None, block_size: int
) -> None:
    """BlockHasher's fast path (it encodes keys itself) gives exactly hash_fn((parent, tokens, keys))."""
    fn = get_hash_fn(algo)
    hasher = BlockHasher(block_size, fn, cache_salt=salt, none_hash=b"seed")
    got: list[bytes] = []
    hasher.extend(got, tokens)
    parent, want = b"seed", []
    for i in range(len(tokens) // block_size):
        parent = fn((parent, tuple(tokens[i * block_size : (i + 1) * block_size]), hasher.extra_keys(i)))
        want.append(parent)
    assert got == want


def test_bad_hasher_arguments_are_refused_with_a_message_that_says_why() -> None:
    fn = get_hash_fn("sha256")
    with pytest.raises(ValueError, match=r"^num_public_blocks must be >= 0, got -1$"):
        BlockHasher(4, fn, num_public_blocks=-1)
    with pytest.raises(ValueError, match=r"^give namespace or cache_salt, not both$"):
        BlockHasher(4, fn, namespace=CacheNamespace(tenant="t"), cache_salt="s")


def test_typed_extra_keys() -> None:
    fn = get_hash_fn("sha256")
    salted = BlockHasher(4, fn, cache_salt="x", none_hash=SEED)
    plain = BlockHasher(4, fn, none_hash=SEED)
    assert salted.extra_keys(0) == (("cache_salt", "x"),) and salted.extra_keys(1) is None
    assert plain.extra_keys(0) is None
    chains = []
    for h in (salted, plain, BlockHasher(4, fn, cache_salt="", none_hash=SEED)):
        out: list[bytes] = []
        h.extend(out, list(range(12)))
        chains.append(out)
    for i in range(3):  # a salt changes every block's hash, not only block 0's
        assert len({c[i] for c in chains}) == 3


def test_none_hash_seed(monkeypatch: pytest.MonkeyPatch) -> None:
    fn = get_hash_fn("sha256")
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    assert init_none_hash(fn) != init_none_hash(fn)
    monkeypatch.setenv("PYTHONHASHSEED", "random")
    assert init_none_hash(fn) != init_none_hash(fn)
    monkeypatch.setenv("PYTHONHASHSEED", "7")
    assert init_none_hash(fn) == init_none_hash(fn) == fn(("brine_none_hash", "7"))
    monkeypatch.setenv("PYTHONHASHSEED", "8")
    assert init_none_hash(fn) != fn(("brine_none_hash", "7"))


_CHILD = """
import json, sys
from kv_cache import CacheNamespace, KVCacheManager
out = {}
for algo in ("sha256", "sha256_cbor", "xxhash", "xxhash_cbor"):
    hashes = []
    KVCacheManager(4, 16, hash_algo=algo).make_hasher(CacheNamespace(salt="salt")).extend(hashes, list(range(64)))
    out[algo] = [h.hex() for h in hashes]
print(json.dumps(out))
"""


def _child_hashes(seed: str | None) -> dict[str, list[str]]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    if seed is not None:
        env["PYTHONHASHSEED"] = seed
    res = subprocess.run(
        [sys.executable, "-c", _CHILD], cwd=ROOT, env=env, capture_output=True, text=True, check=True
    )
    return json.loads(res.stdout)


def test_hashes_reproduce_across_processes_only_with_pythonhashseed() -> None:
    a, b = _child_hashes("42"), _child_hashes("42")
    assert a == b and all(len(v) == 4 for v in a.values())
    c = _child_hashes(None)
    assert all(set(a[k]).isdisjoint(c[k]) for k in a)  # random seed: nothing shared with a restart


def test_importing_kv_cache_does_not_import_torch() -> None:
    code = (  # every module of the package, so that a new one is checked too
        "import importlib, pkgutil, sys, kv_cache\n"
        "for m in pkgutil.iter_modules(kv_cache.__path__): importlib.import_module('kv_cache.' + m.name)\n"
        "assert 'torch' not in sys.modules, 'kv_cache imported torch'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True)
