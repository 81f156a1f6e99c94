"""`tool_choice: "auto"` through the app over a real engine with a tiny Qwen2 model whose chat template renders
tools (Qwen2.5's): the template gets the tools, and a `<tool_call>` block in the output comes back as
`tool_calls` (whole and streamed, read with the OpenAI SDK's strict models). The random model is made to
write the block by a `guided_choice` constraint beside the tools, so the output is known in advance.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import openai
import pytest
from fastapi.testclient import TestClient
from server_helpers import assert_error
from tiny_qwen import build_tiny_qwen

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from server.app import create_app

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ASK = [{"role": "user", "content": "Weather in Paris?"}]
BLOCK = 'Sure.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AsyncEngine]:
    # Named nothing like Qwen: auto is served because of the template, not the name.
    path = build_tiny_qwen(tmp_path_factory.mktemp("tiny-model"))
    engine = AsyncEngine.from_config(
        EngineConfig(model=str(path), device="cpu", num_blocks=64, max_model_len=1024)
    )
    yield engine
    engine.shutdown()


@pytest.fixture(scope="module")
def http(engine: AsyncEngine) -> Iterator[TestClient]:
    with TestClient(create_app(engine)) as c:
        yield c


@pytest.fixture(scope="module")
def sdk(http: TestClient) -> openai.OpenAI:
    return openai.OpenAI(
        base_url="http://testserver/v1",
        api_key="x",
        http_client=http,
        max_retries=0,
        _strict_response_validation=True,
    )


def _ask(sdk: openai.OpenAI, engine: AsyncEngine, output: str, **extra: Any) -> Any:
    return sdk.chat.completions.create(
        model=engine.model_name,
        messages=ASK,  # type: ignore[arg-type]
        tools=[WEATHER],  # type: ignore[list-item]
        max_tokens=200,
        temperature=0,
        extra_body={"guided_choice": [output]},
        **extra,
    )


def test_auto_returns_the_block_as_a_tool_call(sdk: openai.OpenAI, engine: AsyncEngine) -> None:
    choice = _ask(sdk, engine, BLOCK).choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Sure."
    (call,) = choice.message.tool_calls or []
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}


def test_auto_streams_content_then_the_call(sdk: openai.OpenAI, engine: AsyncEngine) -> None:
    chunks = list(_ask(sdk, engine, BLOCK, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    content = "".join(d.content or "" for d in deltas)
    calls = [tc for d in deltas for tc in d.tool_calls or ()]
    assert content == "Sure."
    head, *pieces = calls
    assert head.id and head.id.startswith("call_") and head.function and head.function.name == "get_weather"
    assert len(pieces) > 1 and all(p.index == 0 and p.id is None for p in pieces)  # arguments come in pieces
    assert json.loads("".join(p.function.arguments or "" for p in pieces if p.function)) == {"city": "Paris"}
    last = content_done = None
    for i, d in enumerate(deltas):
        if d.tool_calls and content_done is None:
            content_done = i
        if d.content:
            last = i
    assert last is not None and content_done is not None and last < content_done  # content before the call
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_auto_without_a_block_is_plain_content(sdk: openai.OpenAI, engine: AsyncEngine) -> None:
    choice = _ask(sdk, engine, "It is sunny in Paris.").choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == "It is sunny in Paris." and not choice.message.tool_calls


def test_the_template_gets_the_tools_and_earlier_calls(http: TestClient, engine: AsyncEngine) -> None:
    history = [
        *ASK,
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    body = {"model": engine.model_name, "messages": history, "tools": [WEATHER]}
    r = http.post("/v1/chat/completions/render", json=body)
    assert r.status_code == 200, r.text
    prompt = engine.tokenizer.decode(r.json()["token_ids"], skip_special_tokens=False)
    assert "<tools>" in prompt and '"name": "get_weather"' in prompt
    # The earlier call's arguments reach the template as an object (not a JSON string quoted again).
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in prompt
    assert "<tool_response>\nsunny\n</tool_response>" in prompt
    # tool_choice "none": the model is not shown the tools.
    r = http.post("/v1/chat/completions/render", json={**body, "tool_choice": "none"})
    assert "<tools>" not in engine.tokenizer.decode(r.json()["token_ids"], skip_special_tokens=False)


def test_malformed_tools_are_400s_with_auto(http: TestClient, engine: AsyncEngine) -> None:
    body = {"model": engine.model_name, "messages": ASK, "tools": [{"type": "function"}], "max_tokens": 4}
    assert_error(http.post("/v1/chat/completions", json=body), 400, "tools")
