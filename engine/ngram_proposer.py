"""Prompt-lookup drafts: the tokens that followed the latest earlier occurrence of a request's last n tokens.

One `NgramIndex` per request, over that request's own tokens (prompt and output so far) and nothing else:
no table is shared between requests, so a draft can never carry one tenant's text into another's request
(llama.cpp's n-gram pool and vLLM's suffix tree are shared). A draft only changes speed anyway: the verifier
keeps the tokens the model would have produced.

The index maps every `min_n`-gram to the positions where it ends, and grows as tokens are appended (O(1) per
token; a 2,000-token prompt is indexed once, ~1 ms). A lookup takes the request's last `min_n` tokens, tries
their most recent earlier occurrences, extends each match backwards up to `max_n` tokens, and proposes what
followed the longest (the most recent of equals): answers quoting a document continue where the quote began.
"""

from __future__ import annotations

from collections.abc import Sequence

# Earlier occurrences tried per lookup, most recent first: bounds the cost on text that repeats one n-gram
# thousands of times (any of them proposes something; the longest of the latest few is as good a guess).
MAX_CANDIDATES = 32


class NgramIndex:
    """Where each `n`-gram of one token sequence ends. The caller appends to its own list and calls `extend`;
    it never edits or shortens the list otherwise (a truncated request is finished, its index dropped)."""

    __slots__ = ("n", "ends", "indexed")

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        self.n = n
        self.ends: dict[tuple[int, ...], list[int]] = {}  # n-gram -> end positions (exclusive), ascending
        self.indexed = 0  # n-grams ending at positions <= this are in `ends`

    def extend(self, tokens: Sequence[int]) -> None:
        n, ends = self.n, self.ends
        for end in range(max(self.indexed + 1, n), len(tokens) + 1):
            key = tuple(tokens[end - n : end])
            found = ends.get(key)
            if found is None:
                ends[key] = [end]
            else:
                found.append(end)
        self.indexed = max(self.indexed, len(tokens))

    def propose(self, tokens: Sequence[int], k: int, max_n: int) -> list[int]:
        """Up to `k` tokens that followed the longest (up to `max_n`) match of the sequence's suffix; [] when
        its last `n` tokens never occurred before. Indexes what was appended since the last call first."""
        self.extend(tokens)
        length, n = len(tokens), self.n
        if k < 1 or length <= n:
            return []
        found = self.ends.get(tuple(tokens[length - n :]))
        if not found or len(found) < 2:  # the suffix itself is the only occurrence
            return []
        best_len, best_end = 0, -1
        tried = 0
        for end in reversed(found):
            if end >= length:
                continue
            tried += 1
            m = n
            while m < max_n and end - m - 1 >= 0 and tokens[end - m - 1] == tokens[length - m - 1]:
                m += 1
            if m > best_len:
                best_len, best_end = m, end
                if m >= max_n:
                    break
            if tried >= MAX_CANDIDATES:
                break
        return list(tokens[best_end : min(best_end + k, length)])
