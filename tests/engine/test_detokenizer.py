"""Incremental detokenization and stop strings, with a byte-level tokenizer (one UTF-8 byte per token).

The real tokenizer's multilingual round trip is in test_engine_e2e.py (slow: it needs the default model).
"""

from __future__ import annotations

import pytest
from engine_fakes import ByteTokenizer, FakeRunner, collect, make_core, run_to_completion, scripted

from engine.detokenizer import IncrementalDetokenizer, TextStream
from engine.outputs import FinishReason
from engine.sampling_params import SamplingParams

TEXTS = ["plain ascii", "日本語のテキスト", "مرحبا بالعالم", "emoji 👩‍👩‍👧 🎉 and 🇯🇵", "mixé ñ ß ∑ 𝔘"]


@pytest.mark.parametrize("text", TEXTS)
def test_deltas_concatenate_to_the_full_decode_and_never_break_utf8(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    detok = IncrementalDetokenizer(tok.decode, tok.encode("prompt: "))
    deltas = [detok.step(i) for i in ids]
    assert "".join(deltas) + detok.flush() == tok.decode(ids) == text
    assert not any("\ufffd" in d for d in deltas)
    if len(text.encode()) > len(text):  # multi-byte characters: some bytes complete nothing on their own
        assert "" in deltas


def test_an_incomplete_character_at_the_end_is_flushed_as_the_full_decode_shows_it():
    tok = ByteTokenizer()
    ids = tok.encode("ok 日")[:-1]  # drop the last byte of a 3-byte character
    detok = IncrementalDetokenizer(tok.decode)
    streamed = "".join(detok.step(i) for i in ids)
    assert streamed == "ok "
    assert streamed + detok.flush() == tok.decode(ids)


def stream_text(text: str, **params) -> tuple[list[str], TextStream, str | None]:
    """Feeds `text` byte by byte; returns the deltas taken after each token, the stream, the stop hit."""
    tok = ByteTokenizer()
    stream = TextStream(tok.decode, [], SamplingParams(**params))
    deltas, hit = [], None
    for i in tok.encode(text):
        hit = stream.add_token(i)
        deltas.append(stream.take_delta(finished=hit is not None))
        if hit is not None:
            break
    return deltas, stream, hit


def test_stop_string_is_cut_and_a_partial_match_is_never_shown():
    deltas, stream, hit = stream_text("foo STOP bar", stop=["STOP"])
    assert hit == "STOP" and "".join(deltas) == "foo " == stream.text
    assert not any("S" in d for d in deltas)


def test_a_partial_match_that_fails_is_released_in_order():
    deltas, stream, hit = stream_text("ab STx cd", stop=["STOP"])
    assert hit is None and "".join(deltas) + stream.take_delta(finished=True) == "ab STx cd"
    # The last len("STOP") - 1 characters are always held: "S" and "ST" are only shown once "x" resolved them.
    assert deltas == ["", "", "", "a", "b", " ", "S", "T", "x"]


def test_the_holdback_is_the_longest_stop_minus_one_and_none_when_the_stop_is_output():
    deltas, stream, _ = stream_text("0123456789", stop=["ab", "wxyz"])
    assert "".join(deltas) == "0123456" and stream.take_delta(finished=True) == "789"
    deltas, _, _ = stream_text("0123456789", stop=["wxyz"], include_stop_str_in_output=True)
    assert deltas == list("0123456789")


def test_stop_matching_cost_does_not_grow_with_the_text_or_the_number_of_prefixes(monkeypatch):
    """Each token searches only its new text plus the longest stop's reach: no pass over every prefix of every
    stop (the old holdback tested up to len(stop) - 1 prefixes per stop per token)."""
    stop = "x" * 1000 + "!"
    tok = ByteTokenizer()
    stream = TextStream(tok.decode, [], SamplingParams(stop=[stop, "y" * 1000 + "?"]))
    calls = []
    real_endswith = str.endswith

    class Spy(str):
        def endswith(self, *a):  # pragma: no cover - only called by the old per-prefix holdback
            calls.append(a)
            return real_endswith(self, *a)

    for i in tok.encode("x" * 3000):
        stream.add_token(i)
        stream.text = Spy(stream.text)
        stream.take_delta(finished=False)
    assert calls == [] and stream.stopped_by is None
    assert stream.take_delta(finished=True) == "x" * 1000


def test_earliest_stop_wins_and_include_stop_str_in_output():
    deltas, _, hit = stream_text("one, two. three", stop=[".", ", t"])
    assert hit == ", t" and "".join(deltas) == "one"
    deltas, _, hit = stream_text("say hi! more", stop=["!"], include_stop_str_in_output=True)
    assert hit == "!" and "".join(deltas) == "say hi!"


def test_stop_strings_wait_for_min_tokens():
    deltas, _, hit = stream_text("a.b.c", stop=["."], min_tokens=3)
    assert hit == "." and "".join(deltas) == "a.b"


def test_engine_streams_held_back_text_and_stops_the_request():
    runner = FakeRunner(num_blocks=32, next_token=scripted("Hi there STOP and on"))
    core = make_core(runner)
    core.add_request("r", [1, 2, 3], SamplingParams(max_tokens=50, stop=["STOP"], temperature=0))
    outputs = run_to_completion(core)
    deltas = [c.text for o in outputs for c in o.outputs]
    assert "".join(deltas) == "Hi there "
    assert not any(ch in d for d in deltas for ch in "STOP")
    final = outputs[-1].outputs[0]
    assert final.finish_reason is FinishReason.STOP and final.stop_reason == "STOP"
    # The request stopped at the token that completed the stop string: no more steps ran for it.
    assert sum(len(c.token_ids) for o in outputs for c in o.outputs) == len("Hi there STOP")


def test_a_stop_string_completed_by_the_last_allowed_token_reports_stop():
    core = make_core(FakeRunner(num_blocks=32, next_token=scripted("abc!")))
    core.add_request("r", [5], SamplingParams(max_tokens=4, stop=["c!"], temperature=0))
    seq = collect(run_to_completion(core), "r")[0]
    assert seq["text"] == "ab" and seq["finish_reason"] is FinishReason.STOP and seq["stop_reason"] == "c!"


def test_engine_output_of_multibyte_text_streams_exactly():
    text = "naïve 日本 🎉!"
    core = make_core(FakeRunner(num_blocks=32, next_token=scripted(text)))
    core.add_request("r", [7, 8], SamplingParams(max_tokens=len(text.encode()), temperature=0))
    outputs = run_to_completion(core)
    deltas = [c.text for o in outputs for c in o.outputs]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
