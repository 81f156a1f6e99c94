"""OpenAI's Responses API through a real `brine serve` with the default model, spoken to with the official
`openai` SDK (strict response validation) and the OpenAI Agents SDK: create, the stream helper, a forced tool,
a `text.format` schema, a conversation continued with `previous_response_id` whose cached tokens grow, and
stored responses that other salts cannot read."""

from __future__ import annotations

import contextlib
import io
import json
import re

import openai
import pytest
from e2e_server import ROOT, BrineServer
from pydantic import BaseModel, Field

pytestmark = pytest.mark.slow  # the real server with the default model

SYSTEM = (
    "You are the support assistant of ACME Rockets. Answer in one short sentence. ACME sells model rockets, "
    "launch pads and igniters; orders ship within two days; returns are free for thirty days."
)
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "The current weather in a city.",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}},
        "required": ["city"],
        "additionalProperties": False,
    },
    "strict": True,
}


class City(BaseModel):
    name: str = Field(max_length=40)
    country: str = Field(max_length=40)


def test_create_returns_a_message_with_responses_usage(
    client: openai.OpenAI, brine_server: BrineServer
) -> None:
    r = client.responses.create(
        model=brine_server.model,
        instructions=SYSTEM,
        input="Do you sell launch pads?",
        max_output_tokens=24,
        temperature=0,
        extra_body={"cache_salt": "e2e-responses-create"},
    )
    assert r.status in ("completed", "incomplete") and r.output_text.strip()
    assert r.output[0].type == "message"
    assert r.usage is not None and r.usage.input_tokens > 20 and 0 < r.usage.output_tokens <= 24
    assert r.usage.total_tokens == r.usage.input_tokens + r.usage.output_tokens
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    assert r.usage.input_tokens_details.cached_tokens == 0  # a salt nobody used before
    assert r.usage.input_tokens_details.cache_write_tokens > 0


def test_stream_helper_gets_the_final_response(client: openai.OpenAI, brine_server: BrineServer) -> None:
    with client.responses.stream(
        model=brine_server.model,
        instructions=SYSTEM,
        input="How fast do orders ship?",
        max_output_tokens=200,
        temperature=0,
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert kinds.count("response.output_text.delta") > 1
    assert final.status == "completed" and final.output_text.strip()
    assert client.responses.retrieve(final.id).output_text == final.output_text


def test_a_forced_tool_returns_a_function_call_whose_arguments_parse(
    client: openai.OpenAI, brine_server: BrineServer
) -> None:
    r = client.responses.create(
        model=brine_server.model,
        input="What is the weather in Paris?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice="required",
        max_output_tokens=60,
        temperature=0,
    )
    [call] = r.output
    assert call.type == "function_call" and call.name == "get_weather"
    assert isinstance(json.loads(call.arguments)["city"], str)
    # The client runs the tool and sends its output back, continuing the stored conversation.
    done = client.responses.create(
        model=brine_server.model,
        previous_response_id=r.id,
        input=[{"type": "function_call_output", "call_id": call.call_id, "output": "Sunny, 21 C."}],
        max_output_tokens=30,
        temperature=0,
    )
    assert done.output[0].type == "message" and done.output_text.strip()


def test_a_streamed_forced_tool_sends_argument_deltas(
    client: openai.OpenAI, brine_server: BrineServer
) -> None:
    with client.responses.stream(
        model=brine_server.model,
        input="What is the weather in Rome?",
        tools=[WEATHER],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        max_output_tokens=60,
        temperature=0,
    ) as stream:
        deltas = [e.delta for e in stream if e.type == "response.function_call_arguments.delta"]
        final = stream.get_final_response()
    [call] = final.output
    assert call.type == "function_call" and len(deltas) > 1 and "".join(deltas) == call.arguments
    assert isinstance(json.loads(call.arguments)["city"], str)


def test_text_format_schema_parses(client: openai.OpenAI, brine_server: BrineServer) -> None:
    r = client.responses.parse(
        model=brine_server.model,
        input="Name a city in France, as JSON.",
        text_format=City,
        max_output_tokens=100,
        temperature=0,
    )
    assert r.status == "completed"
    assert isinstance(r.output_parsed, City)


def test_previous_response_id_continues_from_the_cache(
    client: openai.OpenAI, brine_server: BrineServer
) -> None:
    salt = {"cache_salt": "e2e-responses-conversation"}
    turns = ["Do you sell igniters?", "How long do I have to return one?", "Is shipping fast?"]
    previous: str | None = None
    cached: list[int] = []
    for question in turns:
        r = client.responses.create(
            model=brine_server.model,
            instructions=SYSTEM,
            input=question,
            previous_response_id=previous,
            max_output_tokens=24,
            temperature=0,
            extra_body=salt,
        )
        assert r.usage is not None
        cached.append(r.usage.input_tokens_details.cached_tokens)
        previous = r.id
    # Each turn's prompt starts with the whole previous turn: more of it comes from the cache every time.
    assert cached[0] == 0 < cached[1] < cached[2]
    # The stored response belongs to its salt: without it, the id is unknown.
    assert client.responses.retrieve(previous, extra_query=salt).id == previous
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(previous)
    with pytest.raises(openai.BadRequestError) as err:
        client.responses.create(model=brine_server.model, input="hi", previous_response_id=previous)
    assert err.value.code == "previous_response_not_found"


async def test_an_agents_sdk_agent_calls_its_function_tool(brine_server: BrineServer) -> None:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # nothing leaves this machine
    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The current weather in a city."""
        calls.append(city)
        return f"Sunny in {city}."

    client = openai.AsyncOpenAI(
        base_url=f"{brine_server.base_url}/v1",
        api_key=brine_server.api_key,
        max_retries=0,
        timeout=300,
        _strict_response_validation=True,
    )
    agent = agents.Agent(
        name="weather",
        instructions="You answer questions about the weather.",
        tools=[get_weather],
        model=agents.OpenAIResponsesModel(model=brine_server.model, openai_client=client),
        # The default model's template has no tool-call format of its own: the call is forced, and the
        # tool's answer is the agent's.
        model_settings=agents.ModelSettings(tool_choice="required", temperature=0, max_tokens=60),
        tool_use_behavior="stop_on_first_tool",
    )
    result = await agents.Runner.run(agent, "What is the weather in Paris?")
    assert len(calls) == 1 and calls[0]
    assert result.final_output == f"Sunny in {calls[0]}."


def test_readme_responses_example_runs_and_reads_the_first_turn_from_the_cache(
    brine_server: BrineServer,
) -> None:
    section = (ROOT / "README.md").read_text().split("## The Responses and Messages APIs", 1)[1]
    match = re.search(r"```python\n(.*?)```", section, re.S)  # the first example: Responses
    assert match and "client.responses.create" in match.group(1), "README has no Responses example"
    code = match.group(1)
    assert 'base_url="http://127.0.0.1:8000/v1"' in code and 'api_key="unused"' in code
    code = code.replace("http://127.0.0.1:8000/v1", f"{brine_server.base_url}/v1")
    code = code.replace('api_key="unused"', f'api_key="{brine_server.api_key}"')
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})  # our own docs, on purpose
    printed = out.getvalue().rstrip("\n")
    text, cached = printed.rsplit("\n", 1)
    assert text.strip(), "the example printed no answer"
    assert int(cached) > 0  # the second turn starts with the first, whole blocks of it cached
