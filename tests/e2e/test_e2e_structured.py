"""Structured outputs and forced tool calls through a real `brine serve` with the default model, spoken to
with the OpenAI SDK: `parse(response_format=Model)`, json_object, vLLM's guided_* extras, named and required
tool_choice (streamed too), schemas that cannot compile, random small schemas (hypothesis), and the batch
guarantee: free requests give the same tokens with or without constrained neighbours.
"""

from __future__ import annotations

import asyncio
import json
import re
from enum import Enum

import httpx
import jsonschema
import openai
import pytest
from e2e_server import BrineServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from prometheus_client.parser import text_string_to_metric_families
from pydantic import BaseModel, Field

MSG = [{"role": "user", "content": "Describe a person called Ada as JSON."}]


class Color(str, Enum):
    red = "red"
    green = "green"
    blue = "blue"


class Pet(BaseModel):
    name: str
    legs: int = Field(ge=0, le=8)


class Person(BaseModel):
    name: str
    age: int = Field(ge=0, le=120)
    favourite: Color
    pets: list[Pet] = Field(max_length=3)


def _post(server: BrineServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(f"{server.base_url}{path}", json=body, headers=server.headers, timeout=300)


def test_parse_returns_the_pydantic_object(client: openai.OpenAI, brine_server: BrineServer) -> None:
    done = client.chat.completions.parse(
        model=brine_server.model, messages=MSG, response_format=Person, max_tokens=200, temperature=0
    )
    choice = done.choices[0]
    assert choice.finish_reason == "stop", choice.message.content
    assert isinstance(choice.message.parsed, Person)
    Person.model_validate_json(choice.message.content or "")


def test_parse_streams_to_the_pydantic_object(client: openai.OpenAI, brine_server: BrineServer) -> None:
    with client.chat.completions.stream(
        messages=MSG,
        response_format=Person,
        max_tokens=200,
        temperature=0.8,
        seed=3,
        model=brine_server.model,
    ) as stream:
        deltas = [e for e in stream if e.type == "content.delta"]
        final = stream.get_final_completion()
    assert len(deltas) > 1  # streamed, not one blob
    assert isinstance(final.choices[0].message.parsed, Person)


def test_json_object_and_nested_schema_with_arrays_enums_and_bounded_ints(
    client: openai.OpenAI, brine_server: BrineServer
) -> None:
    out = client.chat.completions.create(
        model=brine_server.model,
        # An object the model copies: asked to invent one ("Describe Ada as JSON"), the 135M model's greedy
        # object ran ~200 tokens with one kernel's last bits and repeated keys past 400 with another.
        messages=[
            {"role": "user", "content": 'Reply with this JSON object only: {"name": "Ada", "age": 36}'}
        ],
        response_format={"type": "json_object"},
        # Room for the whole object: a reply cut by max_tokens is unfinished JSON whatever the grammar does.
        max_tokens=200,
        temperature=0,
    )
    assert out.choices[0].finish_reason == "stop", out.choices[0].message.content
    assert isinstance(json.loads(out.choices[0].message.content or ""), dict)
    schema = Person.model_json_schema()
    out = client.chat.completions.create(
        model=brine_server.model,
        messages=MSG,
        max_tokens=200,
        temperature=1.0,
        seed=11,
        response_format={
            "type": "json_schema",
            "json_schema": {"name": "p", "schema": schema, "strict": True},
        },
    )
    jsonschema.validate(json.loads(out.choices[0].message.content or ""), schema)


def test_completions_route_and_vllm_extras(client: openai.OpenAI, brine_server: BrineServer) -> None:
    done = client.completions.create(
        model=brine_server.model,
        prompt="The answer is",
        max_tokens=10,
        extra_body={"guided_choice": ["yes", "no", "maybe so"]},
    )
    assert done.choices[0].text in {"yes", "no", "maybe so"}
    body = {"messages": MSG, "max_tokens": 20, "guided_regex": r"[0-9]{3}-[a-z]{2}"}
    text = _post(brine_server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
    assert re.fullmatch(r"[0-9]{3}-[a-z]{2}", text)
    schema = {"type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}
    for extra in ({"guided_json": schema}, {"structured_outputs": {"json": json.dumps(schema)}}):
        body = {"messages": MSG, "max_tokens": 30, "temperature": 0, **extra}
        text = _post(brine_server, "/v1/chat/completions", body).json()["choices"][0]["message"]["content"]
        jsonschema.validate(json.loads(text), schema)


def test_bad_schemas_and_conflicts_are_400s_naming_the_field(brine_server: BrineServer) -> None:
    bad = {
        "type": "json_schema",
        "json_schema": {"name": "x", "schema": {"type": "object", "minProperties": "x"}},
    }
    cases = [
        ({"response_format": bad}, "response_format"),
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, None),
        ({"guided_regex": "(unclosed"}, "guided_regex"),
        ({"guided_json": "{not json"}, "guided_json"),
        ({"guided_choice": []}, "guided_choice"),
        ({"guided_regex": "a", "guided_choice": ["a"]}, "guided_choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
    ]
    for extra, param in cases:
        r = _post(brine_server, "/v1/chat/completions", {"messages": MSG, "max_tokens": 5, **extra})
        assert r.status_code == 400, (extra, r.text)
        err = r.json()["error"]
        if param is not None:
            assert err["param"] == param, (extra, err)


WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "unit": {"type": "string", "enum": ["c", "f"]}},
            "required": ["city", "unit"],
            "additionalProperties": False,
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {"type": "object", "properties": {"zone": {"type": "string"}}, "required": ["zone"]},
    },
}
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]


def _check_call(name: str, arguments: str) -> None:
    assert name in {"get_weather", "get_time"}
    schema = (WEATHER if name == "get_weather" else TIME)["function"]["parameters"]
    jsonschema.validate(json.loads(arguments), schema)


@pytest.mark.parametrize(
    "tool_choice",
    [{"type": "function", "function": {"name": "get_weather"}}, "required"],
    ids=["named", "required"],
)
def test_forced_tool_calls(client: openai.OpenAI, brine_server: BrineServer, tool_choice) -> None:
    out = client.chat.completions.create(
        model=brine_server.model,
        messages=ASK,
        tools=[WEATHER, TIME],
        tool_choice=tool_choice,
        max_tokens=100,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.id.startswith("call_") and call.type == "function"
    if isinstance(tool_choice, dict):
        assert call.function.name == "get_weather"
    _check_call(call.function.name, call.function.arguments)

    # Streamed: OpenAI's tool-call deltas (id and name first, then argument pieces), same call.
    chunks = list(
        client.chat.completions.create(
            model=brine_server.model,
            messages=ASK,
            tools=[WEATHER, TIME],
            tool_choice=tool_choice,
            max_tokens=100,
            temperature=0,
            stream=True,
        )
    )
    pieces = [tc for c in chunks for ch in c.choices for tc in (ch.delta.tool_calls or [])]
    assert pieces and pieces[0].id and pieces[0].function.name == call.function.name
    assert all(p.index == 0 for p in pieces)
    arguments = "".join(p.function.arguments or "" for p in pieces)
    _check_call(pieces[0].function.name, arguments)
    assert json.loads(arguments) == json.loads(call.function.arguments)
    assert [ch.finish_reason for c in chunks for ch in c.choices if ch.finish_reason] == ["tool_calls"]


def test_a_named_call_cut_short_is_still_that_call_with_finish_length(
    client: openai.OpenAI, brine_server: BrineServer
) -> None:
    named = {"type": "function", "function": {"name": "get_weather"}}
    out = client.chat.completions.create(
        model=brine_server.model,
        messages=ASK,
        tools=[WEATHER],
        tool_choice=named,
        max_tokens=3,
        temperature=0,
    )
    choice = out.choices[0]
    assert choice.finish_reason == "length"
    (call,) = choice.message.tool_calls or []
    assert call.function.name == "get_weather" and call.function.arguments.startswith("{")


def test_tool_choice_auto_and_unknown_names_are_400s(brine_server: BrineServer) -> None:
    for choice, param in (
        ("auto", "tool_choice"),
        ({"type": "function", "function": {"name": "nope"}}, "tool_choice"),
    ):
        body = {"messages": ASK, "tools": [WEATHER], "tool_choice": choice, "max_tokens": 5}
        r = _post(brine_server, "/v1/chat/completions", body)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


def test_free_requests_are_untouched_by_constrained_neighbours(
    brine_server: BrineServer, async_client: openai.AsyncOpenAI
) -> None:
    """8 concurrent requests, half constrained: the free half's tokens equal what they give alone."""
    prompts = [f"Write a short line about the number {i}." for i in range(4)]

    async def free(p: str, seed: int):
        r = await async_client.completions.create(
            model=brine_server.model, prompt=p, max_tokens=24, temperature=0.9, seed=seed
        )
        return r.choices[0].text

    async def constrained(i: int):
        r = await async_client.chat.completions.create(
            model=brine_server.model,
            messages=MSG,
            max_tokens=40,
            temperature=0.9,
            seed=i,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "p", "schema": Person.model_json_schema()},
            },
        )
        return r.choices[0].message.content

    async def run():
        alone = [await free(p, i) for i, p in enumerate(prompts)]
        mixed = await asyncio.gather(
            *[free(p, i) for i, p in enumerate(prompts)], *[constrained(i) for i in range(4)]
        )
        return alone, list(mixed[:4])

    alone, mixed = asyncio.run(run())
    assert mixed == alone


def _samples(server: BrineServer) -> dict[tuple[str, str], float]:
    r = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=10)
    return {
        (s.name, s.labels.get("kind", "")): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
        if s.name.startswith(("brine_structured_output", "brine_grammar"))
    }


def test_structured_output_metrics(brine_server: BrineServer, client: openai.OpenAI) -> None:
    before = _samples(brine_server)
    client.chat.completions.create(
        model=brine_server.model,
        messages=MSG,
        max_tokens=5,
        extra_body={"guided_regex": "[a-z]{1,3}[0-9]{1,3}q"},
    )
    after = _samples(brine_server)
    key = ("brine_structured_output_requests_total", "regex")
    assert after[key] == before[key] + 1
    assert (
        after[("brine_structured_output_requests_total", "json_object")]
        == before[("brine_structured_output_requests_total", "json_object")]
    )
    count = ("brine_grammar_compile_seconds_count", "")
    assert after[count] == before[count] + 1  # a regex never seen before: compiled once


_NAMES = st.sampled_from(["a", "b", "c", "id", "tag"])


def _schemas(depth: int = 0) -> st.SearchStrategy[dict]:
    leaves = st.one_of(
        st.just({"type": "string", "maxLength": 8}),
        st.builds(
            lambda lo, span: {"type": "integer", "minimum": lo, "maximum": lo + span},
            st.integers(-50, 50),
            st.integers(0, 100),
        ),
        st.just({"type": "boolean"}),
        st.lists(st.sampled_from(["x", "y", "z w"]), min_size=1, max_size=3, unique=True).map(
            lambda e: {"enum": e}
        ),
    )
    if depth >= 2:
        return leaves
    inner = _schemas(depth + 1)
    objects = st.dictionaries(_NAMES, inner, min_size=1, max_size=3).map(
        lambda props: {
            "type": "object",
            "properties": props,
            "required": sorted(props),
            "additionalProperties": False,
        }
    )
    arrays = inner.map(lambda items: {"type": "array", "items": items, "maxItems": 3})
    return st.one_of(leaves, objects, arrays)


@settings(max_examples=6, deadline=None, suppress_health_check=list(HealthCheck), derandomize=True)
@given(schema=_schemas())
def test_random_schemas_always_validate(
    client: openai.OpenAI, brine_server: BrineServer, schema: dict
) -> None:
    out = client.chat.completions.create(
        model=brine_server.model,
        messages=[{"role": "user", "content": "Reply with JSON."}],
        max_tokens=160,
        temperature=1.0,
        seed=5,
        response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    )
    choice = out.choices[0]
    if choice.finish_reason == "length":  # the model ran out of room: only a whole answer must validate
        return
    jsonschema.validate(json.loads(choice.message.content or ""), schema)
