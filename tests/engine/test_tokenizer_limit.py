"""`Tokenizer.encode(limit=...)`: a prompt over the context length is refused before all of it is tokenized
(at once where characters prove it, else after the piece that passes the limit), the tokens of a prompt
within the limit are unchanged, and long decodes give the same text through the GIL-releasing path. The
default model's tokenizer (byte-level BPE, splittable)."""

from __future__ import annotations

import random
from typing import Any

import pytest

from engine.errors import ContextLengthError
from engine.model.loading.files import resolve_model
from engine.tokenizer import LONG_DECODE, Tokenizer
from kv_cache.namespace import CacheNamespace

WORDS = ["river", "Stone", "cloud's", "42", "naïve", "end.", "\n", "tiger", "中文", "a", "Zed", "  "]


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    return Tokenizer(resolve_model(None).path)


class _CountingBackend:
    """The Rust tokenizer, counting the characters it is asked to encode."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.chars = 0

    def encode_batch(self, texts: list[str], **kwargs: Any) -> Any:
        self.chars += sum(len(t) for t in texts)
        return self.inner.encode_batch(texts, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def _text(chars: int, seed: int = 0) -> str:
    rng = random.Random(seed)
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


@pytest.fixture
def counting(tok: Tokenizer) -> Any:
    real = tok.backend
    spy = _CountingBackend(real)
    tok.backend = spy
    yield spy
    tok.backend = real


def test_a_prompt_far_over_the_limit_is_refused_without_tokenizing_it(tok: Tokenizer, counting: Any) -> None:
    assert tok.max_chars_per_token is not None and tok.max_chars_per_token >= 16
    text = _text(4_000_000)
    for reuse in (False, True):
        with pytest.raises(ContextLengthError, match="more than 8192 tokens"):
            tok.encode(text, reuse=reuse, namespace=CacheNamespace(salt="s"), limit=8192)
    assert counting.chars == 0


@pytest.mark.parametrize("reuse", [False, True])
def test_a_prompt_over_the_limit_stops_after_the_piece_that_passes_it(
    tok: Tokenizer, counting: Any, reuse: bool
) -> None:
    text = _text(600_000, seed=1)
    limit = 8000  # far fewer tokens than the text has, but more than chars / max_chars_per_token
    assert tok.max_chars_per_token is not None and len(text) <= limit * tok.max_chars_per_token
    with pytest.raises(ContextLengthError):
        tok.encode(text, reuse=reuse, namespace=CacheNamespace(salt=f"stop-{reuse}"), limit=limit)
    assert 0 < counting.chars < len(text) // 4


@pytest.mark.parametrize("reuse", [False, True])
def test_within_the_limit_the_tokens_are_the_same(tok: Tokenizer, reuse: bool) -> None:
    text = _text(120_000, seed=2)
    whole = tok.encode(text)
    ns = CacheNamespace(salt=f"same-{reuse}")
    assert tok.encode(text, reuse=reuse, namespace=ns, limit=len(whole)) == whole
    # Over by one: refused or returned whole (the server's own check then words the 400 exactly).
    try:
        again = tok.encode(text, reuse=reuse, namespace=ns, limit=len(whole) - 1)
    except ContextLengthError:
        pass
    else:
        assert again == whole


def test_long_decodes_give_the_same_text(tok: Tokenizer) -> None:
    ids = tok.encode(_text(40_000, seed=3))
    assert len(ids) > LONG_DECODE
    assert tok.decode(ids) == tok.backend.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=False) == tok.backend.decode(ids, skip_special_tokens=False)
