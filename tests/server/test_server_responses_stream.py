"""`/v1/responses` with `stream: true` over the fake engine: the documented event sequence, `event:` lines that
agree with each event's type, consecutive sequence numbers, the SDK's `responses.stream()` helper, and the
same output as without streaming."""

from __future__ import annotations

import json
from typing import Any

import openai
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import MODEL

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def events(text: str) -> list[dict[str, Any]]:
    """Each SSE event's data; asserts the framing (`event: TYPE`, `data: JSON`, a blank line) and that the
    `event:` line names the data's type."""
    assert text.endswith("\n\n")
    out = []
    for block in text.split("\n\n")[:-1]:
        head, data = block.split("\n")
        assert head.startswith("event: ") and data.startswith("data: "), block
        event = json.loads(data[len("data: ") :])
        assert head[len("event: ") :] == event["type"]
        out.append(event)
    assert [e["sequence_number"] for e in out] == list(range(len(out)))
    return out


def stream(client: TestClient, **extra: Any) -> list[dict[str, Any]]:
    r = client.post("/v1/responses", json={"model": MODEL, "input": "hi", "stream": True, **extra})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream"), r.text
    return events(r.text)


def test_a_text_response_streams_the_documented_sequence(client: TestClient, engine: FakeEngine) -> None:
    engine.eos_after = 5
    evs = stream(client, max_output_tokens=20, temperature=0)
    kinds = [e["type"] for e in evs]
    deltas = kinds.count("response.output_text.delta")
    assert deltas >= 2
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert evs[0]["response"]["status"] == "in_progress" and evs[0]["response"]["output"] == []
    final = evs[-1]["response"]
    text = "".join(e["delta"] for e in evs if e["type"] == "response.output_text.delta")
    assert evs[-4]["text"] == text == final["output"][0]["content"][0]["text"]
    assert final["status"] == "completed" and final["usage"]["output_tokens"] == 5
    item_id = evs[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in evs[3:-2])
    # Stored as it was sent, and the same as the response without streaming.
    assert client.get(f"/v1/responses/{final['id']}").json() == final
    plain = client.post(
        "/v1/responses", json={"model": MODEL, "input": "hi", "max_output_tokens": 20, "temperature": 0}
    ).json()
    assert plain["output"][0]["content"] == final["output"][0]["content"]


def test_a_cut_short_stream_ends_incomplete(client: TestClient) -> None:
    evs = stream(client, max_output_tokens=3)
    assert evs[-1]["type"] == "response.incomplete"
    final = evs[-1]["response"]
    assert final["status"] == "incomplete" and final["incomplete_details"] == {"reason": "max_output_tokens"}
    assert final["output"][0]["status"] == "incomplete"


def test_a_forced_call_streams_function_call_argument_events(client: TestClient, engine: FakeEngine) -> None:
    engine.eos_after = 6
    evs = stream(
        client, tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"}, max_output_tokens=30
    )
    kinds = [e["type"] for e in evs]
    deltas = kinds.count("response.function_call_arguments.delta")
    assert deltas >= 1
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        *["response.function_call_arguments.delta"] * deltas,
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    added, done = evs[2]["item"], evs[-2]["item"]
    assert added["type"] == "function_call" and added["name"] == "get_weather" and added["arguments"] == ""
    arguments = "".join(e["delta"] for e in evs if e["type"] == "response.function_call_arguments.delta")
    assert done["arguments"] == arguments == evs[-3]["arguments"] and done["call_id"] == added["call_id"]
    assert evs[-1]["response"]["output"] == [done]


def test_the_sdk_stream_helper_accepts_the_stream(client: TestClient, engine: FakeEngine) -> None:
    engine.eos_after = 4
    sdk = openai.OpenAI(
        base_url="http://testserver/v1",
        api_key="unused",
        http_client=client,
        max_retries=0,
        _strict_response_validation=True,
    )
    with sdk.responses.stream(model=MODEL, input="hi", max_output_tokens=20) as s:
        text = "".join(e.delta for e in s if e.type == "response.output_text.delta")
        final = s.get_final_response()
    assert final.status == "completed" and final.output_text == text and text
    assert engine.num_used_blocks() == 0


def test_an_engine_failure_mid_stream_is_an_error_event_then_failed(
    client: TestClient, engine: FakeEngine
) -> None:
    engine.error_after = 2
    evs = stream(client, max_output_tokens=20)
    assert [e["type"] for e in evs[-2:]] == ["error", "response.failed"]
    assert (
        evs[-1]["response"]["status"] == "failed" and evs[-1]["response"]["error"]["code"] == "server_error"
    )
    assert engine.num_used_blocks() == 0
