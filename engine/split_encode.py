"""Where a long prompt may be cut so that its pieces, tokenized apart, give exactly the tokens of the whole.

Why: in the Rust `tokenizers` backend, the pre-tokenizer (the GPT-2 regex, run by Oniguruma) is most of the
cost of encoding: 2.4 ms of 2.9 ms for an 11 KB, 2,000-token prompt on a 2-core EPYC. `encode_batch`
spreads a batch over its threads with the GIL released, so a long prompt cut into one piece per core encodes
~1.4x faster there (2.6 -> 1.9 ms), and every repeat of a long shared document pays that once per request;
longer texts gain more (see TARGET_PIECE_CHARS).

When the pieces' tokens are the whole's: the cut is at an ASCII space between two ASCII letters ("...a| b..."),
and the tokenizer is one whose encoding is, per pre-token, independent of its neighbours (checked from its
JSON by `why_not_splittable`):
- a pre-tokenizer that is either byte-level with the GPT-2 regex
  (`'s|'t|'re|'ve|'m|'ll|'d| ?\\p{L}+| ?\\p{N}+| ?[^\\s\\p{L}\\p{N}]+|\\s+(?!\\S)|\\s+`) and no prefix space, or
  a Split on Llama 3's or Qwen2's regex (SPLIT_REGEXES) then byte-level without a regex or prefix space;
- no normalizer, or NFC (Qwen2's): a space between ASCII letters is a boundary NFC never composes across;
- a BPE model without dropout, no truncation or padding, and a post-processor that adds no token to a single
  sequence but, at most, special tokens before it (Llama 3's BOS: `special_prefix`, put back once);
- added (special) tokens that hold no whitespace and strip none, so a cut at a space is never inside one, and
  the text between them is pre-tokenized piece by piece anyway.
Under each of those regexes, a letter and the space after it are never in one match (no alternative matches a
letter followed by a space: a space only ever opens a match, and `(?!\\S)` looks only at whitespace), so every
match left of the cut ends at the letter in both the whole and the left piece, and matching restarts at the
space in both; the regexes have no lookbehind. ASCII letters only: they are `\\p{L}` in every Unicode version,
so Python and Oniguruma agree. BPE then encodes each pre-token on its own. tests/engine/test_split_encode.py
checks the pieces against the whole on random and adversarial texts with the default model's tokenizer and
with Llama 3- and Qwen2-style ones built in the test.
"""

from __future__ import annotations

import re
from typing import Any

MIN_PIECE_CHARS = 4096  # shorter pieces: the threads' start-up costs more than they save
# Longer pieces cost more per character, even on one thread: 104 KB (20,000 tokens) took 31 ms whole, 10 ms in
# 4 pieces; 313 KB 102 ms whole, 35 ms in 8 (2 cores).
TARGET_PIECE_CHARS = 32768
# Pieces kept for reuse (engine.piece_cache): small enough that a new question after a long shared document
# re-encodes little of it (one piece at most), big enough that the pieces of a cold 11 KB prompt, encoded in
# one batch, cost about what it costs in one piece per core (1.3 against 1.2 ms).
REUSE_PIECE_CHARS = 2048
_CUT = re.compile(r"(?<=[A-Za-z]) (?=[A-Za-z])")
_LETTERS_THEN = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|"
_THEN = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# The Split pre-tokenizer regexes of Llama 3 (digits in threes) and Qwen2 (one digit at a time), as their
# tokenizer.json files spell them.
SPLIT_REGEXES = frozenset({_LETTERS_THEN + r"\p{N}{1,3}" + _THEN, _LETTERS_THEN + r"\p{N}" + _THEN})


def why_not_splittable(config: dict[str, Any]) -> str | None:
    """None when a tokenizer with this `tokenizer.json` content may be cut as the module says; else why not."""
    normalizer = config.get("normalizer")
    if normalizer is not None and normalizer != {"type": "NFC"}:
        return "it has a normalizer other than NFC"
    if config.get("truncation") is not None or config.get("padding") is not None:
        return "it truncates or pads"
    if not _splittable_pre_tokenizer(config.get("pre_tokenizer") or {}):
        return (
            "its pre-tokenizer is neither byte-level with the GPT-2 regex nor a Split on Llama 3's or Qwen2's "
            "regex then byte-level, with no prefix space"
        )
    model = config.get("model") or {}
    if model.get("type") != "BPE" or model.get("dropout") not in (None, 0, 0.0):
        return "its model is not a BPE without dropout"
    if _template(config) is None:
        return "its post-processor may add tokens other than special tokens before the text"
    for tok in config.get("added_tokens") or []:
        content = tok.get("content", "")
        if tok.get("lstrip") or tok.get("rstrip") or any(ch.isspace() for ch in content):
            return f"added token {content!r} strips or holds whitespace"
    return None


def cut_points(text: str, pieces: int) -> list[int]:
    """Where to cut `text` into at most `pieces` pieces of at least MIN_PIECE_CHARS: for each even share, the
    first safe cut (a space between ASCII letters) after it. Ascending, never 0 or len(text); none when the text
    is too short or has no such space."""
    pieces = min(pieces, len(text) // MIN_PIECE_CHARS)
    cuts: list[int] = []
    for k in range(1, pieces):
        m = _CUT.search(text, max(len(text) * k // pieces, cuts[-1] + MIN_PIECE_CHARS if cuts else 0))
        if m is None:
            break
        if len(text) - m.start() < MIN_PIECE_CHARS:
            break
        cuts.append(m.start())
    return cuts


def _splittable_pre_tokenizer(pre: dict[str, Any]) -> bool:
    if pre.get("type") == "ByteLevel":
        return bool(pre.get("use_regex", True)) and not pre.get("add_prefix_space")
    steps = pre.get("pretokenizers") if pre.get("type") == "Sequence" else None
    if not steps or len(steps) != 2:
        return False
    split, byte_level = steps
    return (
        split.get("type") == "Split"
        and (split.get("pattern") or {}).get("Regex") in SPLIT_REGEXES
        and split.get("behavior") == "Isolated"
        and not split.get("invert")
        and byte_level.get("type") == "ByteLevel"
        and not byte_level.get("use_regex", True)
        and not byte_level.get("add_prefix_space")
    )


def _template(config: dict[str, Any]) -> list[int] | None:
    """The ids the post-processor puts before a single sequence ([] for none), or None where it may add any
    other token (after the text, or one it does not name). ByteLevel post-processing only trims offsets."""
    post = config.get("post_processor")
    steps = [] if post is None else post.get("processors", []) if post.get("type") == "Sequence" else [post]
    prefix: list[int] = []
    for step in steps:
        if step.get("type") == "ByteLevel":
            continue
        if step.get("type") != "TemplateProcessing" or prefix:
            return None
        single = step.get("single") or []
        kinds = [
            "Sequence" if "Sequence" in item else "SpecialToken" if "SpecialToken" in item else "?"
            for item in single
        ]
        if kinds.count("Sequence") != 1 or kinds[-1] != "Sequence" or "?" in kinds:
            return None
        for item in single[:-1]:
            special = (step.get("special_tokens") or {}).get(item["SpecialToken"].get("id"), {})
            ids = special.get("ids")
            if not isinstance(ids, list) or not ids:
                return None
            prefix += [int(i) for i in ids]
    return prefix


def special_prefix(config: dict[str, Any]) -> list[int]:
    """The special token ids a splittable tokenizer's post-processor puts before a single sequence (Llama 3's
    BOS), which pieces encoded without special tokens leave out: the whole's tokens are these, then the
    pieces'."""
    prefix = _template(config)
    if prefix is None:
        raise ValueError("not a splittable tokenizer")
    return prefix


def reuse_cut_points(text: str) -> list[int]:
    """Where to cut `text` into pieces whose tokens can be reused by a later text that starts the same way
    (engine.piece_cache): the first safe cut at or after each multiple of REUSE_PIECE_CHARS (after the one
    before). Each cut depends only on the text up to the letter after it, never on what follows, so two texts
    that share their first n characters share every cut below n - 1, and with it every piece before those."""
    cuts: list[int] = []
    start = REUSE_PIECE_CHARS
    while start < len(text):
        m = _CUT.search(text, start)
        if m is None:
            break
        cuts.append(m.start())
        start = (m.start() // REUSE_PIECE_CHARS + 1) * REUSE_PIECE_CHARS
    return cuts


def split_for_reuse(text: str) -> list[str]:
    """`text` cut at `reuse_cut_points` (one piece when there is no cut)."""
    bounds = [0, *reuse_cut_points(text), len(text)]
    return [text[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]


def split(text: str, cores: int) -> list[str]:
    """`text` cut at `cut_points` into one piece per core, or per TARGET_PIECE_CHARS where that is more (one
    piece when there is no cut)."""
    bounds = [0, *cut_points(text, max(cores, len(text) // TARGET_PIECE_CHARS)), len(text)]
    return [text[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=True)]
