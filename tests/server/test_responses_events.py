"""`ResponseBuilder` on its own: chat deltas as the Hermes-style parser makes them (content, then calls, then
content again) become items in order, each opened and closed with its events, sequence numbers unbroken."""

from __future__ import annotations

from typing import Any

from server.responses_events import ResponseBuilder


def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}


def call_head(index: int, call_id: str, name: str) -> dict[str, Any]:
    return {
        "tool_calls": [
            {"index": index, "id": call_id, "type": "function", "function": {"name": name, "arguments": ""}}
        ]
    }


def call_args(index: int, text: str) -> dict[str, Any]:
    return {"tool_calls": [{"index": index, "function": {"arguments": text}}]}


def test_content_and_calls_interleave_into_items_in_order() -> None:
    b = ResponseBuilder()
    events: list[dict[str, Any]] = []
    for delta in (
        {"content": "Sure."},
        call_head(0, "call_a", "get_weather"),
        call_args(0, '{"city": '),
        call_args(0, '"Paris"}'),
        call_head(1, "call_b", "get_time"),
        call_args(1, "{}"),
        {"content": "Done"},
    ):
        events += b.feed(chunk(delta))
    events += b.feed(chunk({}, "tool_calls"))
    events += b.finish()
    kinds = [e["type"] for e in events]
    assert kinds == [
        "response.output_item.added",  # the message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",  # call a
        "response.function_call_arguments.delta",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",  # call b
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.output_item.added",  # the closing message
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
    ]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    assert [item["type"] for item in b.output] == ["message", "function_call", "function_call", "message"]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.added"] == [0, 1, 2, 3]
    assert b.output[1]["arguments"] == '{"city": "Paris"}' and b.output[1]["call_id"] == "call_a"
    assert b.output[2]["name"] == "get_time" and b.output[3]["content"][0]["text"] == "Done"
    assert all(item["status"] == "completed" for item in b.output)
    assert b.finish_reason == "tool_calls"


def test_an_output_cut_short_leaves_its_open_item_incomplete() -> None:
    b = ResponseBuilder()
    b.feed(chunk(call_head(0, "call_a", "f")))
    b.feed(chunk(call_args(0, '{"x": 1')))
    b.feed(chunk({}, "length"))
    done = b.finish()
    assert [e["type"] for e in done] == ["response.function_call_arguments.done", "response.output_item.done"]
    assert b.output[0]["status"] == "incomplete" and done[-1]["item"]["arguments"] == '{"x": 1'
