"""Prompt pieces reused across prompts (engine/piece_cache.py, `Tokenizer.encode(reuse=True)`): the tokens are
always a fresh encoding's, a repeated document is not encoded again, and nothing is shared across cache
namespaces or kept past a reset.

The cuts (split_encode.reuse_cut_points) are checked to depend only on the text before them, which is what
lets a prompt that starts like an earlier one find its pieces; exactness of the cuts themselves is
tests/engine/test_split_encode.py's.
"""

from __future__ import annotations

import random
from array import array

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import split_encode
from engine.piece_cache import PieceCache
from engine.split_encode import reuse_cut_points, split_for_reuse
from engine.tokenizer import Tokenizer
from kv_cache.namespace import CacheNamespace

pytestmark = pytest.mark.slow

WORDS = [
    "river",
    "Stone",
    "cloud's",
    "42",
    "naïve",
    "end.",
    "\n",
    "<|im_end|>",
    "  tiger",
    "中文",
    "a",
    "Zed",
]
TENANT_A = CacheNamespace(tenant="a")
TENANT_B = CacheNamespace(tenant="b")


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from engine.model.loading.files import resolve_model

    return Tokenizer(resolve_model(None).path)


@pytest.fixture
def fresh(tok: Tokenizer) -> Tokenizer:
    tok.pieces = PieceCache()
    return tok


def document(seed: int, words: int) -> str:
    rng = random.Random(seed)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def whole(tok: Tokenizer, text: str) -> list[int]:
    return tok.backend.encode_batch([text], add_special_tokens=True)[0].ids


def test_a_repeated_document_is_encoded_once_and_keeps_its_tokens(fresh: Tokenizer) -> None:
    doc = document(0, 3000)  # ~20 KB: ~10 pieces
    first = fresh.encode(doc, reuse=True)
    assert first == whole(fresh, doc)
    pieces = len(split_for_reuse(doc))
    assert pieces >= 5 and fresh.pieces.misses == pieces and fresh.pieces.hits == 0
    assert fresh.encode(doc, reuse=True) == first
    assert fresh.pieces.hits == pieces and fresh.pieces.misses == pieces


def test_a_new_question_after_a_shared_document_encodes_only_the_end(fresh: Tokenizer) -> None:
    doc = document(1, 3000)
    fresh.encode(doc + " What is the first word?", reuse=True)
    before = fresh.pieces.misses
    for question in (" And the last one?", "\nWhich words repeat most often, and why would they?"):
        text = doc + question
        assert fresh.encode(text, reuse=True) == whole(fresh, text)
    # Each question misses only the piece it ends: the document's other pieces are found.
    assert fresh.pieces.misses - before == 2
    assert fresh.pieces.hits >= 2 * (len(split_for_reuse(doc)) - 1)


def test_pieces_are_never_shared_across_namespaces(fresh: Tokenizer) -> None:
    doc = document(2, 2000)
    n = len(split_for_reuse(doc))
    fresh.encode(doc, reuse=True, namespace=TENANT_A)
    fresh.encode(doc, reuse=True, namespace=TENANT_B)
    fresh.encode(doc, reuse=True, namespace=CacheNamespace(tenant="a", salt="s"))
    fresh.encode(doc, reuse=True)  # the shared, unsalted namespace
    assert fresh.pieces.hits == 0 and fresh.pieces.misses == 4 * n
    fresh.encode(doc, reuse=True, namespace=TENANT_B)
    assert fresh.pieces.hits == n


def test_without_reuse_nothing_is_kept_or_looked_up(fresh: Tokenizer) -> None:
    doc = document(3, 2000)
    assert fresh.encode(doc) == whole(fresh, doc)
    assert len(fresh.pieces) == 0 and fresh.pieces.hits == fresh.pieces.misses == 0


def test_forgetting_an_owner_drops_only_its_pieces(fresh: Tokenizer) -> None:
    doc = document(4, 2000)
    n = len(split_for_reuse(doc))
    for ns in (TENANT_A, CacheNamespace(tenant="a", salt="x"), TENANT_B, None):
        fresh.encode(doc, reuse=True, namespace=ns)
    fresh.forget_pieces(("tenant", "a"))
    assert len(fresh.pieces) == 2 * n
    for ns in (TENANT_B, None):
        fresh.encode(doc, reuse=True, namespace=ns)
    assert fresh.pieces.hits == 2 * n
    fresh.forget_pieces()
    assert len(fresh.pieces) == 0 and fresh.pieces.chars == 0


def test_the_cache_keeps_at_most_its_characters_least_recently_used_out() -> None:
    cache = PieceCache(max_chars=10)
    ids = array("i", [1])
    cache.store(None, ["aaaa", "bbbb"], [ids, ids])
    assert cache.lookup(None, ["aaaa"]) == [ids]  # now the most recently used
    cache.store(None, ["cccc"], [ids])
    assert cache.chars == 8
    assert cache.lookup(None, ["aaaa", "bbbb", "cccc"]) == [ids, None, ids]
    cache.store(None, ["x" * 11], [ids])  # longer than the whole cache: not kept
    assert cache.chars == 8 and len(cache) == 2


@settings(max_examples=200, deadline=None)
@given(st.lists(st.sampled_from(WORDS + [" ", "  ", "x"]), min_size=1, max_size=400), st.data())
def test_a_cut_depends_only_on_the_text_before_it(parts: list[str], data: st.DataObject) -> None:
    # Small pieces, so that short texts have many cuts.
    text = "".join(parts)
    tail = "".join(data.draw(st.lists(st.sampled_from(WORDS + [" ", "q"]), max_size=30)))
    cut = data.draw(st.integers(0, len(text)))
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(split_encode, "REUSE_PIECE_CHARS", 16)
        a, b = reuse_cut_points(text), reuse_cut_points(text[:cut] + tail)
    # Two texts sharing their first `cut` characters share every cut below cut - 1.
    assert [c for c in a if c < cut - 1] == [c for c in b if c < cut - 1]
    assert all(text[c] == " " and text[c - 1].isascii() and text[c + 1].isascii() for c in a)
