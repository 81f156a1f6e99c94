"""Retention fields over the fake engine: OpenAI's prompt_cache_retention on chat, completions and responses,
Anthropic-style cache_control (ttl 5m | 1h) on chat content parts and on Messages blocks, each reaching the
engine as SamplingParams.retention_s / retention_tokens; any other value is a 400 naming the field."""

from __future__ import annotations

from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import MODEL

CHAT = {"model": MODEL, "max_tokens": 2}


def last(engine: FakeEngine):
    return engine.calls[-1].params


def test_prompt_cache_retention_on_chat_completions_and_responses(
    client: TestClient, engine: FakeEngine
) -> None:
    msgs = [{"role": "user", "content": "keep this"}]
    assert client.post("/v1/chat/completions", json={**CHAT, "messages": msgs}).status_code == 200
    assert last(engine).retention_s == 0
    r = client.post("/v1/chat/completions", json={**CHAT, "messages": msgs, "prompt_cache_retention": "24h"})
    assert (
        r.status_code == 200 and last(engine).retention_s == 86400 and last(engine).retention_tokens is None
    )
    r = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "doc", "prompt_cache_retention": "24h"}
    )
    assert r.status_code == 200 and last(engine).retention_s == 86400
    r = client.post(
        "/v1/completions", json={"model": MODEL, "prompt": "doc", "prompt_cache_retention": "in_memory"}
    )
    assert r.status_code == 200 and last(engine).retention_s == 0
    r = client.post("/v1/responses", json={"model": MODEL, "input": "doc", "prompt_cache_retention": "24h"})
    assert r.status_code == 200 and last(engine).retention_s == 86400
    assert r.json()["prompt_cache_retention"] == "24h"


def test_unknown_retention_values_are_400s_naming_the_field(client: TestClient) -> None:
    msgs = [{"role": "user", "content": "x"}]
    for route, body in (
        ("/v1/chat/completions", {**CHAT, "messages": msgs}),
        ("/v1/completions", {"model": MODEL, "prompt": "x"}),
        ("/v1/responses", {"model": MODEL, "input": "x"}),
    ):
        r = client.post(route, json={**body, "prompt_cache_retention": "48h"})
        assert r.status_code == 400 and r.json()["error"]["param"] == "prompt_cache_retention", route
    for control, param in (
        ({"type": "ephemeral", "ttl": "2h"}, "messages[0].content[0].cache_control.ttl"),
        ({"type": "ephemeral", "ttl": [1]}, "messages[0].content[0].cache_control.ttl"),  # once a 500
        ({"type": "ephemeral", "ttl": {"a": 1}}, "messages[0].content[0].cache_control.ttl"),
        ({"type": "ephemeral", "ttl": "SECRET"}, "messages[0].content[0].cache_control.ttl"),
        ({"type": "persistent"}, "messages[0].content[0].cache_control"),
        ({"type": "ephemeral", "scope": "x"}, "messages[0].content[0].cache_control"),
        ("5m", "messages[0].content[0].cache_control"),
    ):
        part = {"type": "text", "text": "doc", "cache_control": control}
        for route in ("/v1/chat/completions", "/v1/chat/completions/render"):
            r = client.post(route, json={**CHAT, "messages": [{"role": "user", "content": [part]}]})
            assert r.status_code == 400 and r.json()["error"]["param"] == param, (route, control)
            assert "SECRET" not in r.text  # a field's value is never repeated back (server.errors)


def test_cache_control_on_chat_retains_up_to_the_marked_message(
    client: TestClient, engine: FakeEngine
) -> None:
    doc = {
        "type": "text",
        "text": "a long contract " * 5,
        "cache_control": {"type": "ephemeral", "ttl": "1h"},
    }
    msgs = [
        {"role": "system", "content": [doc]},
        {"role": "user", "content": "what does clause 3 say?"},
    ]
    assert client.post("/v1/chat/completions", json={**CHAT, "messages": msgs}).status_code == 200
    params, prompt = last(engine), engine.calls[-1].prompt_token_ids
    assert params.retention_s == 3600
    assert params.retention_tokens is not None and 20 < params.retention_tokens < len(prompt)
    # The retained part is a prefix of what a later question about the same document sends.
    msgs[1]["content"] = "and clause 4?"
    client.post("/v1/chat/completions", json={**CHAT, "messages": msgs})
    assert engine.calls[-1].prompt_token_ids[: params.retention_tokens] == prompt[: params.retention_tokens]
    # Default ttl 5m, on the last message: the whole prompt.
    part = {"type": "text", "text": "q", "cache_control": {"type": "ephemeral"}}
    client.post("/v1/chat/completions", json={**CHAT, "messages": [{"role": "user", "content": [part]}]})
    assert (last(engine).retention_s, last(engine).retention_tokens) == (300, None)


def test_messages_api_ttl_is_honoured(client: TestClient, engine: FakeEngine) -> None:
    user = [
        {"type": "text", "text": "the document", "cache_control": {"type": "ephemeral", "ttl": "1h"}},
        {"type": "text", "text": "the question"},
    ]
    body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": user}]}
    r = client.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    params = last(engine)
    assert params.retention_s == 3600
    assert params.retention_tokens == r.json()["usage"]["cache_creation_input_tokens"]
    user[0]["cache_control"] = {"type": "ephemeral"}
    client.post("/v1/messages", json=body, headers={"anthropic-version": "2023-06-01"})
    assert last(engine).retention_s == 300
