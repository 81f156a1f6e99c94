"""`/v1/responses` over the fake engine: the SDK's strict types, the chat path underneath (template, params,
tools, continuation), the 4xx that name the Responses field, and usage's cache fields."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import MODEL, assert_error

WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


def body(input: Any = "hello there", **extra: Any) -> dict[str, Any]:
    return {"model": MODEL, "input": input, "max_output_tokens": 8, **extra}


@pytest.fixture
def sdk(client: TestClient) -> openai.OpenAI:
    # The SDK over the in-process app: its strict validation checks every object the route returns.
    return openai.OpenAI(
        base_url="http://testserver/v1",
        api_key="unused",
        http_client=client,
        max_retries=0,
        _strict_response_validation=True,
    )


@pytest.fixture(autouse=True)
def blocks_come_back(engine: FakeEngine) -> Iterator[None]:
    yield
    assert engine.num_used_blocks() == 0


def test_create_runs_the_chat_path_and_reports_responses_usage(
    sdk: openai.OpenAI, engine: FakeEngine
) -> None:
    r = sdk.responses.create(
        model=MODEL,
        input="hello there",
        instructions="Be brief.",
        max_output_tokens=8,
        temperature=0.5,
        top_p=0.9,
        metadata={"ticket": "42"},
        user="u-1",
        prompt_cache_key="support-bot",
    )
    assert (
        r.object == "response" and r.id.startswith("resp_") and r.status == "incomplete"
    )  # 8 tokens, no EOS
    assert r.incomplete_details is not None and r.incomplete_details.reason == "max_output_tokens"
    [item] = r.output
    assert item.type == "message" and item.role == "assistant" and item.status == "incomplete"
    assert r.output_text == item.content[0].text and r.output_text
    assert (r.instructions, r.metadata, r.user, r.prompt_cache_key) == (
        "Be brief.",
        {"ticket": "42"},
        "u-1",
        "support-bot",
    )
    assert (r.temperature, r.top_p, r.max_output_tokens, r.store) == (0.5, 0.9, 8, True)
    call = engine.calls[-1]
    assert (call.params.max_tokens, call.params.temperature, call.params.top_p) == (8, 0.5, 0.9)
    messages = engine.tokenizer.template_calls[-1]["messages"]
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello there"},
    ]
    usage = r.usage
    assert usage is not None
    assert usage.input_tokens == len(call.prompt_token_ids) and usage.output_tokens == 8
    assert usage.total_tokens == usage.input_tokens + 8 and usage.output_tokens_details.reasoning_tokens == 0
    # Nothing was cached before; every full block of the prompt was computed and left cached.
    assert usage.input_tokens_details.cached_tokens == 0
    assert usage.input_tokens_details.cache_write_tokens == usage.input_tokens // 4 * 4


def test_message_items_and_function_call_items_reach_the_template(
    sdk: openai.OpenAI, engine: FakeEngine
) -> None:
    sdk.responses.create(
        model=MODEL,
        max_output_tokens=4,
        input=[
            {"role": "developer", "content": "Answer in French."},
            {
                "type": "message",
                "role": "user",
                "content": [{"type": "input_text", "text": "Weather in Paris?"}],
            },
            {
                "type": "function_call",
                "call_id": "call_1",
                "name": "get_weather",
                "arguments": '{"city":"Paris"}',
            },
            {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
        ],
    )
    messages = engine.tokenizer.template_calls[-1]["messages"]
    assert [m["role"] for m in messages] == ["developer", "user", "assistant", "tool"]
    assert messages[1]["content"] == "Weather in Paris?"
    assert messages[2]["tool_calls"][0]["id"] == "call_1"
    assert messages[2]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": {"city": "Paris"}}
    assert messages[3] == {"role": "tool", "content": "sunny", "tool_call_id": "call_1"}


def test_a_forced_tool_call_is_a_function_call_item(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    engine.eos_after = 6
    r = sdk.responses.create(
        model=MODEL,
        input="weather?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=30,
    )
    [item] = r.output
    assert item.type == "function_call" and item.name == "get_weather" and item.status == "completed"
    assert item.call_id.startswith("call_") and item.id and item.id.startswith("fc_")
    assert r.status == "completed" and r.tools[0].name == "get_weather"  # type: ignore[union-attr]
    spec = engine.calls[-1].params.structured
    assert spec is not None and spec.kind == "json_schema" and '"city"' in spec.spec  # the parameters schema


def test_text_format_json_schema_becomes_a_constraint(sdk: openai.OpenAI, engine: FakeEngine) -> None:
    schema = {"type": "object", "properties": {"answer": {"type": "string"}}, "required": ["answer"]}
    r = sdk.responses.create(
        model=MODEL,
        input="hi",
        max_output_tokens=4,
        text={"format": {"type": "json_schema", "name": "reply", "schema": schema, "strict": True}},
    )
    spec = engine.calls[-1].params.structured
    assert spec is not None and spec.kind == "json_schema" and '"answer"' in spec.spec
    assert r.text is not None and r.text.format is not None and r.text.format.type == "json_schema"
    sdk.responses.create(
        model=MODEL, input="hi", max_output_tokens=4, text={"format": {"type": "json_object"}}
    )
    assert engine.calls[-1].params.structured.kind == "json_object"  # type: ignore[union-attr]


def test_previous_response_id_continues_the_conversation_from_the_cache(
    sdk: openai.OpenAI, engine: FakeEngine
) -> None:
    first = sdk.responses.create(
        model=MODEL, input="hello there", instructions="Be brief.", max_output_tokens=8
    )
    second = sdk.responses.create(
        model=MODEL,
        input="and then?",
        instructions="Be brief.",
        previous_response_id=first.id,
        max_output_tokens=8,
    )
    messages = engine.tokenizer.template_calls[-1]["messages"]
    assert messages == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello there"},
        {"role": "assistant", "content": first.output_text},
        {"role": "user", "content": "and then?"},
    ]
    assert second.previous_response_id == first.id
    assert first.usage is not None and second.usage is not None
    # The second prompt starts with the first prompt and its output: their blocks are served from the cache.
    assert second.usage.input_tokens_details.cached_tokens >= first.usage.input_tokens // 4 * 4 > 0
    # Instructions are not carried over (OpenAI's rule): without them the conversation starts with the user.
    sdk.responses.create(model=MODEL, input="more", previous_response_id=second.id, max_output_tokens=4)
    assert engine.tokenizer.template_calls[-1]["messages"][0] == {"role": "user", "content": "hello there"}


def test_get_and_delete_a_stored_response(sdk: openai.OpenAI, client: TestClient) -> None:
    r = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=4)
    got = sdk.responses.retrieve(r.id)
    assert got.model_dump() == r.model_dump()
    sdk.responses.delete(r.id)
    assert_error(client.get(f"/v1/responses/{r.id}"), 404, "response_id", "not_found")
    assert_error(client.delete(f"/v1/responses/{r.id}"), 404, "response_id", "not_found")
    unstored = sdk.responses.create(model=MODEL, input="hi", max_output_tokens=4, store=False)
    assert unstored.store is False
    assert_error(client.get(f"/v1/responses/{unstored.id}"), 404, "response_id", "not_found")
    r = client.post("/v1/responses", json=body(previous_response_id=unstored.id))
    assert_error(r, 400, "previous_response_id", "previous_response_not_found")


@pytest.mark.parametrize(
    ("extra", "param", "code"),
    [
        ({"input": None}, "input", None),
        ({"input": []}, "input", None),
        ({"input": [{"role": "robot", "content": "hi"}]}, "input", None),
        # (a list or an object where a name goes: once a 500, since neither can be looked up in a set)
        ({"input": [{"role": ["user"], "content": "hi"}]}, "input", None),
        ({"input": [{"role": {"a": 1}, "content": "hi"}]}, "input", None),
        ({"input": [{"role": "user", "content": [{"type": ["input_text"], "text": "hi"}]}]}, "input", None),
        (
            {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": [1]}]}]},
            "input",
            None,
        ),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input",
            None,
        ),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input", None),
        ({"input": [{"type": "function_call", "name": "f", "arguments": "{}"}]}, "input", None),
        ({"input": [{"type": "function_call_output", "call_id": "c", "output": 5}]}, "input", None),
        ({"max_output_tokens": 0}, "max_output_tokens", None),
        ({"max_output_tokens": 10_000}, "input", "context_length_exceeded"),  # as chat names messages
        ({"temperature": 3}, "temperature", None),
        ({"stop": ["a", "b", "c", "d", "e"]}, "stop", "array_above_max_length"),
        ({"metadata": {f"k{i}": "v" for i in range(17)}}, "metadata", None),
        ({"metadata": {"k": "v" * 513}}, "metadata", None),
        ({"tools": [{"type": "web_search"}], "tool_choice": "required"}, "tools", None),
        ({"tools": [WEATHER]}, "tool_choice", None),  # "auto": the fake's template has no tool-call format
        ({"tools": [WEATHER], "tool_choice": {"type": "function", "name": "other"}}, "tool_choice", None),
        ({"tools": [WEATHER], "tool_choice": {"type": "mcp"}}, "tool_choice", None),
        ({"tool_choice": {"type": "function", "name": "get_weather"}}, "tool_choice", None),
        ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text", None),
        ({"text": {"format": {"type": "xml"}}}, "text", None),
        (
            {"tools": [WEATHER], "tool_choice": "required", "text": {"format": {"type": "json_object"}}},
            "text",
            None,
        ),
        ({"background": True}, "background", None),
        ({"conversation": "conv_1"}, "conversation", None),
        ({"top_logprobs": 2}, "top_logprobs", None),
        ({"prompt": {"id": "pmpt_1"}}, "prompt", None),
        ({"cache_salt": None}, "cache_salt", "invalid_cache_salt"),
        ({"cache_salt": ""}, "cache_salt", "invalid_cache_salt"),
        ({"prompt_cache_key": ""}, "prompt_cache_key", None),
        ({"previous_response_id": "resp_nope"}, "previous_response_id", "previous_response_not_found"),
        ({"model": "other-model"}, "model", "model_not_found"),
    ],
)
def test_bad_requests_are_4xx_naming_the_responses_field(
    client: TestClient, engine: FakeEngine, extra: dict[str, Any], param: str, code: str | None
) -> None:
    r = client.post("/v1/responses", json=body(**extra))
    assert_error(r, 404 if param == "model" else 400, param, code)
    assert not engine.calls  # refused before anything reached the engine


def test_a_lone_surrogate_is_a_400_naming_the_field(client: TestClient, engine: FakeEngine) -> None:
    raw = '{"input": [{"role": "user", "content": "\\ud800"}], "max_output_tokens": 4}'
    r = client.post("/v1/responses", content=raw, headers={"Content-Type": "application/json"})
    assert_error(r, 400, "input", "invalid_text")
    assert not engine.calls


def test_prompt_cache_key_is_accepted_on_chat_and_completions_and_never_a_namespace(
    client: TestClient, engine: FakeEngine
) -> None:
    chat = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
    completion = {"model": MODEL, "prompt": "hi", "max_tokens": 2}
    for path, request in (("/v1/chat/completions", chat), ("/v1/completions", completion)):
        assert client.post(path, json={**request, "prompt_cache_key": "k1"}).status_code == 200
        assert engine.calls[-1].namespace is None  # the unsalted namespace, as without the key
        assert_error(client.post(path, json={**request, "prompt_cache_key": ""}), 400, "prompt_cache_key")
        assert_error(
            client.post(path, json={**request, "prompt_cache_key": "k" * 1025}), 400, "prompt_cache_key"
        )
    r = client.post("/v1/responses", json=body(prompt_cache_key="k1"))
    assert r.status_code == 200 and engine.calls[-1].namespace is None
