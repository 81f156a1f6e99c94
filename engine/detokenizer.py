"""Token ids -> text as they arrive, without ever emitting broken UTF-8, plus stop-string handling.

`IncrementalDetokenizer` uses the prefix/read-offset method: it decodes a small window of recent ids and
emits only what the newest ids added to the window's text, and only once that text no longer ends in an
incomplete character (U+FFFD from a partial UTF-8 sequence or a byte-fallback token). Decoding a window that
starts a few tokens back, not the single new id, keeps tokenizers whose decoders look at neighbours
(SentencePiece's leading-space rule, cleanup of spaces) exact: the concatenated deltas equal
`decode(all ids)`.

`TextStream` sits on top: it accumulates a sequence's text, cuts it at the first stop string (which is not
output unless asked for) and holds back a tail that might still become a stop string, so a streamed partial
match is never shown and then taken back.

Costs per token do not grow with hostile stop lists (the server caps their number and length too): the search
for a stop looks only at the new text plus the longest stop's length before it, and the tail held back is a
constant, the longest stop's length minus one, computed once per sequence (as vLLM does), instead of testing
every prefix of every stop against the text on every token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from engine.sampling_params import SamplingParams

Decode = Callable[[Sequence[int]], str]

_REPLACEMENT = "\ufffd"
_PROMPT_CONTEXT = 4  # prompt ids that seed the window, so the first output token decodes in context


class IncrementalDetokenizer:
    def __init__(self, decode: Decode, prompt_token_ids: Sequence[int] = ()) -> None:
        self._decode = decode
        self._ids: list[int] = list(prompt_token_ids[-_PROMPT_CONTEXT:])
        self._prefix_offset = 0  # window start: text before it has been emitted
        self._read_offset = len(self._ids)  # ids before it have been emitted

    def step(self, token_id: int) -> str:
        """Adds one id; returns the text it completes ("" while a character is still incomplete)."""
        self._ids.append(token_id)
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT):
            return ""
        # Slide the window; drop what is behind it so the list does not grow with the output.
        del self._ids[: self._read_offset]
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :]

    def flush(self) -> str:
        """At the end of a sequence: whatever is still held (an incomplete character decodes as U+FFFD, just
        as decode(all ids) would show it)."""
        prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        new_text = self._decode(self._ids[self._prefix_offset :])
        self._prefix_offset = self._read_offset = len(self._ids)
        return new_text[len(prefix_text) :] if len(new_text) > len(prefix_text) else ""


class TextStream:
    """One sequence's output text: detokenization, stop strings, and what has been sent so far."""

    def __init__(self, decode: Decode, prompt_token_ids: Sequence[int], params: SamplingParams) -> None:
        self._detok = IncrementalDetokenizer(decode, prompt_token_ids)
        self._stops = list(dict.fromkeys(s for s in params.stop if s))  # duplicates cost, never match more
        self._include_stop = params.include_stop_str_in_output
        # A tail this long might still be the start of a stop string. With include_stop_str_in_output nothing
        # is held: a partial match is shown either way, as text or as the start of the included stop.
        longest = max((len(s) for s in self._stops), default=0)
        self._holdback = 0 if self._include_stop else max(0, longest - 1)
        self._min_tokens = params.min_tokens
        self.text = ""
        self._sent = 0  # len of text already handed out
        self._num_tokens = 0
        self.stopped_by: str | None = None

    def add_token(self, token_id: int, *, skip_text: bool = False) -> str | None:
        """Adds one generated token; returns the stop string it completed, if any (the text is then cut).
        `skip_text`: the token ended the sequence as a stop token / EOS, whose text is not output."""
        self._num_tokens += 1
        if skip_text or self.stopped_by is not None:
            return None
        before = len(self.text)
        self.text += self._detok.step(token_id)
        if self._stops and self._num_tokens >= self._min_tokens and len(self.text) > before:
            return self._find_stop(before)
        return None

    def _find_stop(self, before: int) -> str | None:
        # A match must end in the new text; it may start up to len(stop) - 1 characters before it.
        best: tuple[int, str] | None = None
        for stop in self._stops:
            idx = self.text.find(stop, max(0, before - len(stop) + 1))
            if idx != -1 and (best is None or idx < best[0]):
                best = (idx, stop)
        if best is None:
            return None
        idx, stop = best
        self.text = self.text[: idx + len(stop) if self._include_stop else idx]
        self.stopped_by = stop
        return stop

    def take_delta(self, finished: bool) -> str:
        """Text not yet sent. While unfinished, the last (longest stop string - 1) characters are held back."""
        if finished and self.stopped_by is None:
            self.text += self._detok.flush()
        end = len(self.text) if finished or self.stopped_by is not None else len(self.text) - self._holdback
        if end <= self._sent:
            return ""
        delta = self.text[self._sent : end]
        self._sent = end
        return delta
