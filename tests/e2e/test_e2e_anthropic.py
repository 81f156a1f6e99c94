"""Anthropic's Messages API through a real `brine serve` with the clients people point at it: the `anthropic`
SDK (strict response validation) and LangChain's `ChatAnthropic`. The cache fields tell the truth: a long
system prompt with `cache_control` is created by the first call, read by the second, and not read under
another `cache_salt`; input_tokens (Anthropic's: without cached tokens) and chat's prompt_tokens (OpenAI's:
with them) describe the same prompt."""

from __future__ import annotations

import contextlib
import io
import json
import re
import uuid

import anthropic
import httpx
import pytest
from e2e_server import ROOT, BrineServer
from langchain_anthropic import ChatAnthropic

pytestmark = pytest.mark.slow  # the real server with the default model

# ~500 tokens of a document nobody else sends: its first call is cold whatever ran before on this server.
SYSTEM = "You are a librarian. The catalogue follows.\n" + "\n".join(
    f"Shelf {i}: volumes on {topic}, catalogued in {1900 + i}."
    for i, topic in enumerate(["tides", "salt marshes", "herring", "lighthouses", "kelp", "estuaries"] * 5)
)
# The SDK's create() no longer takes sampling parameters (newer Claude models fix them); the API still does.
GREEDY = {"temperature": 0}
WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}


@pytest.fixture(scope="module")
def sdk(brine_server: BrineServer) -> anthropic.Anthropic:
    return anthropic.Anthropic(
        base_url=brine_server.base_url, api_key=brine_server.api_key, max_retries=0, timeout=300,
        _strict_response_validation=True,
    )  # fmt: skip


def system_tokens(server: BrineServer) -> int:
    r = httpx.post(f"{server.base_url}/tokenize", headers=server.headers, timeout=60,
                   json={"prompt": SYSTEM, "add_special_tokens": False})  # fmt: skip
    return r.json()["count"]


def cached_system() -> list[dict]:
    return [{"type": "text", "text": SYSTEM, "cache_control": {"type": "ephemeral", "ttl": "5m"}}]


def test_create_caches_the_system_prompt_and_reads_it_back(sdk: anthropic.Anthropic, brine_server: BrineServer) -> None:  # fmt: skip
    salt = uuid.uuid4().hex  # this test's own namespace: cold at first, whatever else ran
    n_system = system_tokens(brine_server)

    def call(question: str, cache_salt: str) -> anthropic.types.Message:
        return sdk.messages.create(
            model=brine_server.model, max_tokens=8, system=cached_system(),
            messages=[{"role": "user", "content": question}], extra_body={"cache_salt": cache_salt, **GREEDY},
        )  # fmt: skip

    first = call("Which shelf holds kelp?", salt)
    assert first.usage.cache_read_input_tokens == 0
    created = first.usage.cache_creation_input_tokens
    assert created is not None and n_system - 2 <= created <= n_system + 8  # the system prompt and its header
    total = first.usage.input_tokens + created
    assert first.usage.input_tokens > 0 and first.stop_reason in ("end_turn", "max_tokens")

    second = call("Which shelf holds herring?", salt)
    read = second.usage.cache_read_input_tokens
    assert read is not None and created <= read < created + 16  # the system prompt, up to where they differ
    assert second.usage.cache_creation_input_tokens == 0

    other = call("Which shelf holds kelp?", uuid.uuid4().hex)
    assert other.usage.cache_read_input_tokens == 0 and other.usage.cache_creation_input_tokens == created

    # OpenAI's definition of the same prompt: prompt_tokens counts the cached tokens.
    chat = httpx.post(
        f"{brine_server.base_url}/v1/chat/completions", headers=brine_server.headers, timeout=300,
        json={"model": brine_server.model, "max_tokens": 8, "temperature": 0, "cache_salt": salt,
              "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Which shelf holds kelp?"}]},
    ).json()  # fmt: skip
    assert chat["usage"]["prompt_tokens"] == total
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] > created  # the first call's, and more
    count = sdk.messages.count_tokens(model=brine_server.model, system=cached_system(),
                                      messages=[{"role": "user", "content": "Which shelf holds kelp?"}])  # fmt: skip
    assert count.input_tokens == total


def test_stream_reports_the_same_cache_fields(sdk: anthropic.Anthropic, brine_server: BrineServer) -> None:
    salt = uuid.uuid4().hex
    finals = []
    for _ in range(2):
        with sdk.messages.stream(
            model=brine_server.model, max_tokens=12, system=cached_system(),
            messages=[{"role": "user", "content": "Name one shelf."}], extra_body={"cache_salt": salt, **GREEDY},
        ) as stream:  # fmt: skip
            text = "".join(stream.text_stream)
            finals.append(stream.get_final_message())
        assert finals[-1].content[0].type == "text" and finals[-1].content[0].text == text
    first, second = (f.usage for f in finals)
    assert first.cache_read_input_tokens == 0 and first.cache_creation_input_tokens
    assert second.cache_read_input_tokens >= first.cache_creation_input_tokens
    assert second.cache_creation_input_tokens == 0
    assert finals[0].content[0].text == finals[1].content[0].text  # temperature 0: cached or not, same answer
    assert finals[1].usage.output_tokens > 0


def test_a_forced_tool_returns_tool_use_with_parsed_input(sdk: anthropic.Anthropic, brine_server: BrineServer) -> None:  # fmt: skip
    kw = dict(model=brine_server.model, max_tokens=60, extra_body=GREEDY, tools=[WEATHER],
              tool_choice={"type": "tool", "name": "get_weather"},
              messages=[{"role": "user", "content": "What is the weather in Paris?"}])  # fmt: skip
    msg = sdk.messages.create(**kw)  # type: ignore[arg-type]
    assert msg.stop_reason == "tool_use"
    (block,) = msg.content
    assert block.type == "tool_use" and block.name == "get_weather" and block.id.startswith("toolu_")
    assert isinstance(block.input, dict) and isinstance(block.input["city"], str)
    with sdk.messages.stream(**kw) as stream:  # type: ignore[arg-type]
        deltas = [e.delta.partial_json for e in stream if e.type == "content_block_delta"]
        final = stream.get_final_message()
    assert final.content[0].type == "tool_use" and final.content[0].input == block.input
    assert json.loads("".join(deltas)) == block.input
    # tool_choice "any": the model picks the (only) tool; the answer to a tool_result continues the chat.
    msg = sdk.messages.create(**{**kw, "tool_choice": {"type": "any"}})  # type: ignore[arg-type]
    assert msg.stop_reason == "tool_use" and msg.content[0].type == "tool_use"
    follow = sdk.messages.create(
        model=brine_server.model, max_tokens=16, extra_body=GREEDY, tools=[WEATHER], tool_choice={"type": "none"},
        messages=[kw["messages"][0], {"role": "assistant", "content": msg.content},  # type: ignore[index]
                  {"role": "user", "content": [{"type": "tool_result", "tool_use_id": msg.content[0].id, "content": "Sunny, 24 C"}]}],
    )  # fmt: skip
    assert follow.content[0].type == "text" and follow.stop_reason in ("end_turn", "max_tokens")


def test_langchain_chat_anthropic_invoke_and_stream(brine_server: BrineServer) -> None:
    llm = ChatAnthropic(
        model=brine_server.model, base_url=brine_server.base_url, api_key=brine_server.api_key,
        max_tokens=16, temperature=0, max_retries=0,
    )  # fmt: skip
    answer = llm.invoke("Say hello in one word.")
    assert isinstance(answer.content, str) and answer.content
    assert answer.usage_metadata is not None and answer.usage_metadata["input_tokens"] > 0
    chunks = list(llm.stream("Say hello in one word."))
    streamed = "".join(c.content if isinstance(c.content, str) else "".join(
        p.get("text", "") for p in c.content if isinstance(p, dict)) for c in chunks)  # fmt: skip
    assert streamed == answer.content  # temperature 0, same prompt


def test_readme_messages_example_runs(brine_server: BrineServer) -> None:
    section = (ROOT / "README.md").read_text().split("## The Responses and Messages APIs", 1)[1]
    blocks = re.findall(r"```python\n(.*?)```", section, re.S)
    assert len(blocks) >= 2 and "client.messages.create" in blocks[1], "README has no Messages example"
    code = blocks[1]
    assert 'base_url="http://127.0.0.1:8000"' in code and 'api_key="unused"' in code
    code = code.replace("http://127.0.0.1:8000", brine_server.base_url)
    code = code.replace('api_key="unused"', f'api_key="{brine_server.api_key}"')
    code = code.replace('"tenant-7"', f'"{uuid.uuid4().hex}"')  # cold the first time, whatever ran before
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {})  # our own docs, on purpose
    counts = [tuple(map(int, line.split())) for line in out.getvalue().splitlines() if re.fullmatch(r"\d+ \d+ \d+", line)]  # fmt: skip
    (created, read, rest), (created2, read2, rest2) = counts
    assert created > 0 and read == 0 and rest > 0
    assert created2 == 0 and read2 >= created and rest2 > 0
