"""The Hermes-style tool-call parser (`server.tool_parsers`) on its own: content and calls from whole outputs,
the same result however the text is split into stream pieces, deltas that add up to it, malformed and
cut-short blocks; and which chat templates count as having the format."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from fake_tokenizer import FakeTokenizer
from hypothesis import given, settings
from hypothesis import strategies as st
from tiny_qwen import build_tiny_qwen

from server.tool_parsers import HermesToolParser, parse_tool_calls, supports_hermes_tools

WEATHER = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "days": 3}}\n</tool_call>'
TIME = '<tool_call>\n{"name": "get_time", "arguments": {"tz": "Europe/Paris"}}\n</tool_call>'
# Braces, brackets, an escaped quote and a closing tag's look-alike inside a string argument.
TRICKY = (
    '<tool_call>{"name": "run", "arguments": {"code": "if (a) { b[\\"}\\"] = \\"</tool\\" }", "n": [1, {"x": []}]}}'
    "</tool_call>"
)


def _calls(text: str) -> list[tuple[str, Any]]:
    _, calls = parse_tool_calls(text)
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in calls]


def _streamed(text: str, pieces: list[int]) -> tuple[HermesToolParser, list[dict[str, Any]]]:
    """The parser fed `text` cut at the given offsets, and every delta it returned."""
    parser, deltas, start = HermesToolParser(), [], 0
    for cut in [*sorted(pieces), len(text)]:
        deltas += parser.feed(text[start:cut])
        start = max(start, cut)
    deltas += parser.finish()
    return parser, deltas


def _replay(deltas: list[dict[str, Any]]) -> tuple[str, list[dict[str, str]]]:
    """What a client rebuilds from the deltas, as the OpenAI SDK does: content joined, calls by index."""
    content, calls = "", []
    for delta in deltas:
        assert set(delta) in ({"content"}, {"tool_calls"}), delta
        content += delta.get("content", "")
        for piece in delta.get("tool_calls", ()):
            if piece["index"] == len(calls):  # a new call: id, type and name come first, once
                assert piece["id"].startswith("call_") and piece["type"] == "function"
                calls.append({"id": piece["id"], "name": piece["function"]["name"], "arguments": ""})
            else:
                assert set(piece) == {"index", "function"} and set(piece["function"]) == {"arguments"}
            calls[piece["index"]]["arguments"] += piece["function"]["arguments"]
    return content, calls


def test_plain_text_is_all_content_unchanged() -> None:
    for text in ("Hello there.", "Hi\n\n", "", "a < b and <tool> or <tool_cal", "  spaced  "):
        assert parse_tool_calls(text) == (text, [])
    parser = HermesToolParser()
    assert parser.step("Hi", None) == ([{"content": "Hi"}], None)
    assert parser.step("", "stop") == ([], "stop")


def test_one_call_with_text_before_it() -> None:
    content, calls = parse_tool_calls("Let me check.\n" + WEATHER)
    assert content == "Let me check."
    (call,) = calls
    assert call["type"] == "function" and call["id"].startswith("call_")
    assert call["function"]["name"] == "get_weather"
    assert json.loads(call["function"]["arguments"]) == {"city": "Paris", "days": 3}


def test_several_calls_text_around_them_and_null_content() -> None:
    content, calls = parse_tool_calls(f"{WEATHER}\n{TIME}\n")
    assert content is None
    assert [c["function"]["name"] for c in calls] == ["get_weather", "get_time"]
    assert len({c["id"] for c in calls}) == 2
    content, _ = parse_tool_calls(f"First.\n{WEATHER}\nThen: {TIME}\nDone.\n")
    assert content == "First.Then:Done."  # whitespace next to a call, and at the end after one, is dropped
    assert _calls(TRICKY) == [("run", {"code": 'if (a) { b["}"] = "</tool" }', "n": [1, {"x": []}]})]


def test_malformed_blocks_stay_content_and_good_ones_still_count() -> None:
    bad = '<tool_call>{"name": get_weather}</tool_call>'
    content, calls = parse_tool_calls(f"Try: {bad} {WEATHER}")
    assert content == f"Try: {bad}"
    assert [c["function"]["name"] for c in calls] == ["get_weather"]
    for block in (
        "<tool_call>not json</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        "<tool_call></tool_call>",
    ):
        assert parse_tool_calls(block) == (block, [])
    long_junk = "<tool_call>" + "x" * 3000 + "</tool_call>"
    assert parse_tool_calls(long_junk) == (long_junk, [])


def test_blocks_without_a_streamable_head_are_read_whole() -> None:
    # Other key order, a string for arguments, no arguments at all: still calls, read at the end tag.
    assert _calls('<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>') == [("f", {"a": 1})]
    _, (call,) = parse_tool_calls('<tool_call>{"name": "f", "arguments": "{\\"a\\": 1}"}</tool_call>')
    assert json.loads(call["function"]["arguments"]) == {"a": 1}
    assert _calls('<tool_call>{"name": "f"}</tool_call>') == [("f", {})]
    assert _calls('<tool_call>{"name": "caf\\u00e9", "arguments": {}}</tool_call>') == [("café", {})]


def test_output_ending_inside_a_block() -> None:
    # A call already announced keeps what its arguments got; the route keeps "length" for it.
    parser, deltas = _streamed('Ok <tool_call>{"name": "f", "arguments": {"a": [1, 2', [])
    assert parser.content == "Ok" and [(c.name, c.arguments) for c in parser.calls] == [("f", '{"a": [1, 2')]
    assert parser.finish_reason("length") == "length" and parser.finish_reason("stop") == "tool_calls"
    # An unterminated block that is whole JSON is a call, as vLLM reads a last block without its end tag.
    assert _calls('<tool_call>{"arguments": {"a": 1}, "name": "f"}') == [("f", {"a": 1})]
    # One that is not stays content, without an end tag it never had.
    assert parse_tool_calls("Ok <tool_call>{oops") == ("Ok <tool_call>{oops", [])


def test_stream_deltas_announce_the_call_then_send_argument_pieces() -> None:
    text = "Sure.\n" + WEATHER
    parser, deltas = _streamed(text, list(range(len(text))))  # one character at a time
    assert deltas[0] == {"content": "S"}
    head = next(i for i, d in enumerate(deltas) if "tool_calls" in d)
    assert "".join(d["content"] for d in deltas[:head]) == "Sure."
    first = deltas[head]["tool_calls"][0]
    assert first["function"] == {"name": "get_weather", "arguments": ""} and first["index"] == 0
    pieces = [d["tool_calls"][0]["function"]["arguments"] for d in deltas[head + 1 :]]
    assert len(pieces) > 10 and "".join(pieces) == '{"city": "Paris", "days": 3}'
    assert parser.step("", "stop") == ([], "tool_calls")


TEXTS = [
    "Plain answer, no tools.\n",
    "Let me check.\n" + WEATHER,
    f"{WEATHER}\n{TIME}",
    f"A {WEATHER} b <tool_call>nope</tool_call> c {TRICKY} <tool d\n",
    '<tool_call>{"arguments": {"a": 1}, "name": "f"}</tool_call>',
    'x <tool_call>{"name": "f", "arguments": {"a": "unfinished',
]


@pytest.mark.parametrize("text", TEXTS)
@settings(max_examples=25, deadline=None)
@given(data=st.data())
def test_any_split_gives_the_whole_text_result(text: str, data: st.DataObject) -> None:
    cuts = data.draw(st.lists(st.integers(0, len(text)), max_size=len(text)))
    parser, deltas = _streamed(text, cuts)
    whole_content, whole_calls = parse_tool_calls(text)
    assert parser.content == whole_content
    content, calls = _replay(deltas)
    assert content == (whole_content or "")
    assert [(c["name"], c["arguments"]) for c in calls] == [
        (c["function"]["name"], c["function"]["arguments"]) for c in whole_calls
    ]
    assert [c["id"] for c in calls] == [c.id for c in parser.calls]


def test_template_detection(tmp_path: Path) -> None:
    from engine.tokenizer import Tokenizer

    assert not supports_hermes_tools(FakeTokenizer())  # no template at all
    qwen = Tokenizer(build_tiny_qwen(tmp_path / "qwen"))
    assert supports_hermes_tools(qwen)
    # SmolLM2-135M-Instruct's template (the default model's): no tools, no <tool_call>.
    smol = Tokenizer(tmp_path / "qwen")
    smol.hf.chat_template = (
        "{% for message in messages %}{{'<|im_start|>' + message['role'] + '\\n' + message['content'] + "
        "'<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
    )
    assert not supports_hermes_tools(smol)
    # Mentioning <tool_call> is not enough: the template must also put the tools in the prompt.
    mentions = Tokenizer(tmp_path / "qwen")
    mentions.hf.chat_template = smol.hf.chat_template + "{# models answer with <tool_call> blocks #}"
    assert not supports_hermes_tools(mentions)
    # A tokenizer where <tool_call> is a special token drops it from decoded output: the calls would be lost.
    from tokenizers import AddedToken

    special = Tokenizer(tmp_path / "qwen")
    special.backend.add_special_tokens([AddedToken("<tool_call>", special=True)])
    assert not supports_hermes_tools(special)
