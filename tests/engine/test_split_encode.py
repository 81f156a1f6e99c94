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
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from engine import split_encode
from engine.split_encode import SPLIT_REGEXES, cut_points, special_prefix, split, why_not_splittable
from engine.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

FRAGMENTS = [
    "a", "b", "Z", "word", "Hello", "the", " ", "  ", "   ", "\n", "\n\n", "\t", " \n", "'s", "'ll", "'re", "'",
    "7", "42", "2026", ".", ",", "!?", "--", "(", ")", "é", "über", "naïve", "中文", "日本", "🙂", "👍🏽",
    "<|im_start|>", "<|im_end|>", "<|endoftext|>", "user", "system", "\u00a0", "\u3000", "x\u0301",
]  # fmt: skip


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    from engine.model.loading.files import resolve_model

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

    eos = {"type": "TemplateProcessing", "single": [{"Sequence": {"id": "A", "type_id": 0}},
                                                     {"SpecialToken": {"id": "<s>", "type_id": 0}}],
           "special_tokens": {"<s>": {"id": "<s>", "ids": [1], "tokens": ["<s>"]}}}  # fmt: skip
    unnamed = {"type": "TemplateProcessing", "single": [{"SpecialToken": {"id": "<s>", "type_id": 0}},
                                                         {"Sequence": {"id": "A", "type_id": 0}}]}  # fmt: skip
    split = {
        "type": "Split",
        "pattern": {"Regex": sorted(SPLIT_REGEXES)[0]},
        "behavior": "Isolated",
        "invert": False,
    }
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    cases = {
        "normalizer": changed(["normalizer"], {"type": "NFKC"}),
        "truncates": changed(["truncation"], {"max_length": 8}),
        "pre-tokenizer": changed(["pre_tokenizer"], {"type": "Sequence", "pretokenizers": []}),
        "prefix space": changed(["pre_tokenizer", "add_prefix_space"], True),
        "no regex": changed(["pre_tokenizer", "use_regex"], False),
        "dropout": changed(["model", "dropout"], 0.1),
        "a token after the text": changed(["post_processor"], eos),
        "a token it does not name": changed(["post_processor"], unnamed),
        "another split regex": changed(
            ["pre_tokenizer"],
            {"type": "Sequence", "pretokenizers": [{**split, "pattern": {"Regex": "\\s+"}}, byte_level]},
        ),
        "split, removed": changed(
            ["pre_tokenizer"],
            {"type": "Sequence", "pretokenizers": [{**split, "behavior": "Removed"}, byte_level]},
        ),
        "split then regex": changed(
            ["pre_tokenizer"],
            {"type": "Sequence", "pretokenizers": [split, {**byte_level, "use_regex": True}]},
        ),
        "lstrip": changed(["added_tokens"], [{**base["added_tokens"][0], "lstrip": True}]),
        "space in token": changed(["added_tokens"], [{**base["added_tokens"][0], "content": "<| x |>"}]),
    }
    for name, config in cases.items():
        assert why_not_splittable(config), name


def _styled(tmp: Path, regex: str, nfc: bool) -> Tokenizer:
    """A small byte-level BPE tokenizer shaped like Llama 3's (a Split on its regex, a BOS template) or Qwen2's
    (its regex, NFC), trained here on the fragments: no model files are downloaded."""
    from tokenizers import Regex, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from tokenizers import Tokenizer as Backend
    from transformers import PreTrainedTokenizerFast

    backend = Backend(models.BPE())
    if nfc:
        backend.normalizer = normalizers.NFC()
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(regex), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    backend.decoder = decoders.ByteLevel()
    specials = ["<|begin_of_text|>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"]
    trainer = trainers.BpeTrainer(
        vocab_size=700, special_tokens=specials, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()
    )
    rng = random.Random(1)
    backend.train_from_iterator(["".join(rng.choices(FRAGMENTS, k=60)) for _ in range(400)], trainer)
    if not nfc:  # Llama 3: <|begin_of_text|> before every text encoded with special tokens
        backend.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single="<|begin_of_text|> $A", special_tokens=[("<|begin_of_text|>", 0)]
                ),
            ]
        )
    PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<|endoftext|>").save_pretrained(tmp)
    return Tokenizer(tmp)


@pytest.fixture(scope="module", params=["llama3", "qwen2"])
def styled(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    llama3 = request.param == "llama3"
    regex = next(r for r in SPLIT_REGEXES if ("{1,3}" in r) == llama3)
    return _styled(tmp_path_factory.mktemp(request.param), regex, nfc=not llama3)


def test_llama3_and_qwen2_style_tokenizers_may_be_split(styled: Tokenizer) -> None:
    config = json.loads(styled.backend.to_str())
    assert why_not_splittable(config) is None and styled.encode_pieces > 0
    assert special_prefix(config) == styled.special_prefix == ([0] if config["normalizer"] is None else [])


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(st.lists(st.sampled_from(FRAGMENTS), min_size=1, max_size=120), st.integers(2, 9), st.booleans())
def test_their_pieces_give_the_tokens_of_the_whole(
    styled: Tokenizer, monkeypatch: pytest.MonkeyPatch, parts: list[str], pieces: int, specials: bool
) -> None:
    monkeypatch.setattr(split_encode, "MIN_PIECE_CHARS", 1)
    monkeypatch.setattr(split_encode, "REUSE_PIECE_CHARS", 8)
    monkeypatch.setattr(styled, "encode_pieces", pieces)
    text = "".join(parts)
    want = styled.backend.encode_batch([text], add_special_tokens=specials)[0].ids
    assert styled.encode(text, add_special_tokens=specials) == want, (split(text, pieces), text)
    assert styled.encode(text, add_special_tokens=specials, reuse=True) == want, text


def test_a_cut_inside_a_word_would_be_caught_for_them_too(styled: Tokenizer) -> None:
    """The property above can fail with these tokenizers too: a cut inside a word they merged changes tokens."""
    text = "Hello system user word the Hello"
    changed = []
    for word in ("Hello", "system", "user", "word"):
        cut = text.index(word) + 2
        enc = styled.backend.encode_batch([text[:cut], text[cut:], text], add_special_tokens=False)
        changed.append(enc[0].ids + enc[1].ids != enc[2].ids)
    assert any(changed)
