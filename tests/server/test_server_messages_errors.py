"""The Messages routes refuse bad input with a 4xx in Anthropic's error shape (never a 5xx, never OpenAI's
shape), the message naming the field; errors after a stream started are an `error` event. Also the auto
tool-call mapping from the Hermes parser's deltas to content blocks."""

from __future__ import annotations

from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import MODEL

from server.app import create_app
from server.messages_stream import Blocks
from server.tenancy import TenancyConfig
from server.tool_parsers import HermesToolParser

TOOL = {"name": "get_weather", "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}}}


def body(**extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "max_tokens": 8, "messages": [{"role": "user", "content": "hi"}], **extra}


def assert_anthropic_error(r: Any, status: int, kind: str, mentions: str) -> None:
    assert r.status_code == status, r.text
    data = r.json()
    assert set(data) == {"type", "error"} and data["type"] == "error"
    assert set(data["error"]) == {"type", "message"} and data["error"]["type"] == kind
    assert mentions in data["error"]["message"], data["error"]["message"]


def image(_: Any = None) -> dict[str, Any]:
    return {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}


CC = {"type": "ephemeral"}
BAD: list[tuple[str, dict[str, Any], str]] = [
    ("no max_tokens", {k: v for k, v in body().items() if k != "max_tokens"}, "max_tokens"),
    ("max_tokens 0", body(max_tokens=0), "max_tokens"),
    ("no messages", body(messages=[]), "messages"),
    ("bad role", body(messages=[{"role": "system", "content": "x"}]), "messages"),
    ("an image block", body(messages=[{"role": "user", "content": [image()]}]), "messages"),
    (
        "tool_use from the user",
        body(
            messages=[
                {"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": {}}]}
            ]
        ),
        "messages",
    ),  # fmt: skip
    (
        "tool_result from the assistant",
        body(
            messages=[
                {"role": "user", "content": "q"},
                {"role": "assistant", "content": [{"type": "tool_result", "tool_use_id": "t"}]},
            ]
        ),
        "messages",
    ),  # fmt: skip
    ("system not text", body(system=[image()]), "system"),
    ("temperature above 1", body(temperature=1.5), "temperature"),
    ("top_k negative", body(top_k=-1), "top_k"),
    ("five stop sequences", body(stop_sequences=["a", "b", "c", "d", "e"]), "stop_sequences"),
    ("a long stop sequence", body(stop_sequences=["x" * 2000]), "stop_sequences"),
    (
        "bad cache_control",
        body(system=[{"type": "text", "text": "s", "cache_control": {"type": "forever"}}]),
        "system",
    ),  # fmt: skip
    (
        "bad ttl",
        body(system=[{"type": "text", "text": "s", "cache_control": {"type": "ephemeral", "ttl": "2h"}}]),
        "system",
    ),  # fmt: skip
    (
        "five breakpoints",
        body(system=[{"type": "text", "text": str(i), "cache_control": CC} for i in range(5)]),
        "cache_control",
    ),  # fmt: skip
    ("auto tools on a template without a tool format", body(tools=[TOOL]), "tool_choice"),
    (
        "a tool_choice naming no tool",
        body(tools=[TOOL], tool_choice={"type": "tool", "name": "nope"}),
        "tool_choice",
    ),  # fmt: skip
    ("a tool_choice without a name", body(tools=[TOOL], tool_choice={"type": "tool"}), "tool_choice"),
    ("a server tool", body(tools=[{"type": "web_search_20250305", "name": "web_search"}]), "tools"),
    ("a tool without a schema", body(tools=[{"name": "f"}]), "tools"),
    ("thinking", body(thinking={"type": "enabled", "budget_tokens": 1024}), "thinking"),
    ("null salt", body(cache_salt=None), "cache_salt"),
    ("context too long", body(max_tokens=10_000), "max_tokens"),
]


@pytest.mark.parametrize(("name", "payload", "mentions"), BAD, ids=[b[0] for b in BAD])
def test_bad_input_is_a_400_in_anthropic_shape(
    client: TestClient, name: str, payload: dict[str, Any], mentions: str
) -> None:
    assert_anthropic_error(client.post("/v1/messages", json=payload), 400, "invalid_request_error", mentions)


def test_a_lone_surrogate_is_named(client: TestClient) -> None:
    raw = b'{"max_tokens": 8, "system": "\\ud800", "messages": [{"role": "user", "content": "hi"}]}'
    r = client.post("/v1/messages", content=raw, headers={"content-type": "application/json"})
    assert_anthropic_error(r, 400, "invalid_request_error", "system")


def test_unknown_model_bad_json_and_wrong_method(client: TestClient) -> None:
    assert_anthropic_error(client.post("/v1/messages", json=body(model="claude-x")), 404, "not_found_error", "claude-x")  # fmt: skip
    r = client.post("/v1/messages", content=b"{not json", headers={"content-type": "application/json"})
    assert_anthropic_error(r, 400, "invalid_request_error", "JSON")
    assert_anthropic_error(
        client.post("/v1/messages", json=[1, 2]), 400, "invalid_request_error", "JSON object"
    )
    assert client.get("/v1/messages").json()["type"] == "error"
    # count_tokens refuses alike, and needs no max_tokens
    r = client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": []})
    assert_anthropic_error(r, 400, "invalid_request_error", "messages")
    r = client.post("/v1/messages/count_tokens", json={"model": MODEL, "messages": [{"role": "user", "content": "hi"}]})  # fmt: skip
    assert r.status_code == 200 and r.json()["input_tokens"] > 0
    # The OpenAI routes keep OpenAI's shape.
    assert "type" not in client.post("/v1/chat/completions", json={"messages": []}).json()


def test_required_salt_and_a_dead_engine(engine: FakeEngine) -> None:
    with TestClient(create_app(engine, tenancy=TenancyConfig(require_cache_salt=True))) as client:
        assert_anthropic_error(
            client.post("/v1/messages", json=body()), 400, "invalid_request_error", "cache_salt"
        )
        assert client.post("/v1/messages", json=body(cache_salt="s")).status_code == 200
        engine.healthy = False
        assert_anthropic_error(
            client.post("/v1/messages", json=body(cache_salt="s")), 503, "api_error", "engine"
        )


def test_a_body_over_the_limit_is_request_too_large(engine: FakeEngine) -> None:
    with TestClient(create_app(engine, max_body_bytes=1000)) as client:
        r = client.post("/v1/messages", json=body(system="x" * 2000))
    assert_anthropic_error(r, 413, "request_too_large", "")


def test_an_error_after_the_stream_started_is_an_error_event(engine: FakeEngine, client: TestClient) -> None:
    engine.error_after = 2
    r = client.post("/v1/messages", json=body(stream=True))
    assert r.status_code == 200
    blocks = r.text.strip().split("\n\n")
    assert blocks[0].startswith("event: message_start")
    assert blocks[-1].startswith("event: error\ndata: ") and '"type":"api_error"' in blocks[-1]
    assert engine.num_used_blocks() == 0


def test_auto_tool_calls_become_blocks_whole_or_streamed() -> None:
    text = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    for pieces in ([text], list(text)):
        parser, blocks = HermesToolParser(), Blocks()
        events: list[dict[str, Any]] = []
        for i, piece in enumerate(pieces):
            deltas, _ = parser.step(piece, "stop" if i == len(pieces) - 1 else None)
            for delta in deltas:
                events += blocks.chat_delta(delta)
        events += blocks.close()
        whole = blocks.whole()
        assert [b["type"] for b in whole] == ["text", "tool_use"]
        assert whole[0]["text"] == "Sure." and whole[1]["name"] == "get_weather"
        assert whole[1]["input"] == {"city": "Paris"}
        kinds = [e["type"] for e in events]
        assert kinds[0] == "content_block_start" and kinds.count("content_block_stop") == 2
        json_text = "".join(e["delta"]["partial_json"] for e in events if e["type"] == "content_block_delta"
                            and e["delta"]["type"] == "input_json_delta")  # fmt: skip
        assert json_text.replace(" ", "") == '{"city":"Paris"}'
