"""A long prompt encoded in pieces (engine/split_encode.py) gives exactly the tokens of the whole.

The pieces are checked against one `encode_batch` of the whole text with the default model's tokenizer, on
random texts over an alphabet chosen to meet every branch of the GPT-2 regex (letters, digits, punctuation,
contractions, runs of spaces and newlines, non-ASCII letters, emoji, special tokens), cut far more often than
the server would (MIN_PIECE_CHARS lowered to 1).
"""

from __future__ import annotations

import copy
import json
import random

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import split_encode
from engine.split_encode import cut_points, split, why_not_splittable
from engine.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

FRAGMENTS = [
    "a", "b", "Z", "word", "Hello", "the", " ", "  ", "   ", "\n", "\n\n", "\t", " \n", "'s", "'ll", "'re", "'",
    "7", "42", "2026", ".", ",", "!?", "--", "(", ")", "é", "über", "naïve", "中文", "日本", "🙂", "👍🏽",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "user", "system", "\u00a0", "\u3000", "x\u0301",
]  # fmt: skip


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from engine.model.files import resolve_model

    return Tokenizer(resolve_model(None).path)


def whole(tok: Tokenizer, text: str) -> list[int]:
    return tok.backend.encode_batch([text], add_special_tokens=True)[0].ids


def test_the_default_tokenizer_may_be_split(tok: Tokenizer) -> None:
    assert why_not_splittable(json.loads(tok.backend.to_str())) is None


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=120), st.integers(2, 9))
def test_pieces_give_the_tokens_of_the_whole(
    tok: Tokenizer, monkeypatch: pytest.MonkeyPatch, parts: list[str], pieces: int
) -> None:
    monkeypatch.setattr(split_encode, "MIN_PIECE_CHARS", 1)
    monkeypatch.setattr(tok, "encode_pieces", pieces)
    text = "".join(parts)
    assert tok.encode(text) == whole(tok, text), (split(text, pieces), text)


def test_a_long_document_is_cut_and_keeps_its_tokens(tok: Tokenizer) -> None:
    rng = random.Random(0)
    words = ["river", "Stone", "cloud's", "42", "naïve", "end.", "\n", "<|im_end|>", "  tiger", "中文"]
    text = " ".join(rng.choice(words) for _ in range(6000))
    pieces = split(text, 4)
    assert len(pieces) == 4 and "".join(pieces) == text
    for p in pieces[1:]:
        assert p[0] == " " and p[1].isascii() and p[1].isalpha()  # cut at a space before an ASCII letter
    tok.encode_pieces = 4
    assert tok.encode(text) == whole(tok, text)


def test_a_cut_inside_a_word_would_be_caught(tok: Tokenizer) -> None:
    """The check above can fail: cutting between two letters changes the tokens."""
    text = "Forest paper copper mosaic school purple morning raven yellow amber world dune"
    cut = text.index("mosaic") + 3
    assert tok.encode(text[:cut], False) + tok.encode(text[cut:], False) != whole(tok, text)


def test_cut_points_keep_pieces_long_and_cut_only_at_safe_spaces() -> None:
    text = ("abc " * 5000).rstrip()
    cuts = cut_points(text, 4)
    assert len(cuts) == 3 and cuts == sorted(cuts)
    bounds = [0, *cuts, len(text)]
    assert all(b - a >= split_encode.MIN_PIECE_CHARS for a, b in zip(bounds[:-1], bounds[1:], strict=True))
    assert all(text[c] == " " and text[c - 1].isalpha() and text[c + 1].isalpha() for c in cuts)
    assert cut_points(text[:5000], 4) == []  # too short for two pieces
    assert cut_points("1 2 3 " * 4000, 4) == []  # no space between ASCII letters
    assert cut_points("é é é " * 4000, 4) == []  # non-ASCII letters are not trusted
    assert split("", 4) == [""]


def test_tokenizers_that_may_not_be_split_are_named(tok: Tokenizer) -> None:
    base = json.loads(tok.backend.to_str())

    def changed(path: list[str], value: object) -> dict:
        config = copy.deepcopy(base)
        node = config
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return config

    bos = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                     {"Sequence": {"id": "A", "type_id": 0}}]}  # fmt: skip
    cases = {
        "normalizer": changed(["normalizer"], {"type": "NFC"}),
        "truncates": changed(["truncation"], {"max_length": 8}),
        "pre-tokenizer": changed(["pre_tokenizer"], {"type": "Sequence", "pretokenizers": []}),
        "prefix space": changed(["pre_tokenizer", "add_prefix_space"], True),
        "no regex": changed(["pre_tokenizer", "use_regex"], False),
        "dropout": changed(["model", "dropout"], 0.1),
        "post-processor": changed(["post_processor"], bos),
        "lstrip": changed(["added_tokens"], [{**base["added_tokens"][0], "lstrip": True}]),
        "space in token": changed(["added_tokens"], [{**base["added_tokens"][0], "content": "<| x |>"}]),
    }
    for name, config in cases.items():
        assert why_not_splittable(config), name
