"""`POST /v1/messages` over the fake engine, read with the `anthropic` SDK (strict response validation) where a
client would: the message and stream shapes, stop reasons, the cache fields against the fake's exact block
accounting (block_size 4, one token per character), the conversion into chat, and auth and tenancy."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import anthropic
import httpx2
import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import MODEL

from kv_cache.namespace import CacheNamespace
from server.app import create_app
from server.tenancy import TenancyConfig
from server.tenants import key_hash

KEY = "operator-key"
SYSTEM = "You are a terse assistant who answers in one word. " * 2  # 104 characters: 104 tokens
HEAD = len("<|im_start|>system\n") - len("<|im_start|>") + 1  # the fake's special token is one token


@pytest.fixture
def http(engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(create_app(engine, api_keys=[KEY]), headers={"x-api-key": KEY}) as c:
        yield c


@pytest.fixture
def sdk(http: TestClient) -> anthropic.Anthropic:
    """The SDK (its own httpx2) over the app: each request is passed to the TestClient."""

    def forward(request: httpx2.Request) -> httpx2.Response:
        r = http.request(
            request.method,
            request.url.raw_path.decode(),
            headers=dict(request.headers),
            content=request.read(),
        )
        headers = [
            (k, v) for k, v in r.headers.multi_items() if k not in ("content-length", "content-encoding")
        ]
        return httpx2.Response(r.status_code, headers=headers, content=r.content)

    return anthropic.Anthropic(
        base_url="http://testserver",
        api_key=KEY,
        http_client=httpx2.Client(transport=httpx2.MockTransport(forward)),
        max_retries=0,
        _strict_response_validation=True,
    )


def cached_system(text: str = SYSTEM, ttl: str | None = None) -> list[dict[str, Any]]:
    cc: dict[str, Any] = {"type": "ephemeral", **({"ttl": ttl} if ttl else {})}
    return [{"type": "text", "text": text, "cache_control": cc}]


def ask(sdk: anthropic.Anthropic, **kw: Any) -> Any:
    kw.setdefault("messages", [{"role": "user", "content": "hi"}])
    return sdk.messages.create(model=MODEL, max_tokens=kw.pop("max_tokens", 6), **kw)


def prompt_len(sdk: anthropic.Anthropic, **kw: Any) -> int:
    kw.setdefault("messages", [{"role": "user", "content": "hi"}])
    return sdk.messages.count_tokens(model=MODEL, **kw).input_tokens


def test_a_message_and_its_usage_add_up_to_the_prompt(sdk: anthropic.Anthropic, engine: FakeEngine) -> None:
    msg = ask(sdk, system=SYSTEM)
    assert msg.id.startswith("msg_") and msg.type == "message" and msg.role == "assistant"
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text
    assert msg.stop_reason == "max_tokens" and msg.stop_sequence is None
    u = msg.usage
    assert u.output_tokens == 6
    total = len(engine.calls[-1].prompt_token_ids)
    assert total == prompt_len(sdk, system=SYSTEM)
    # No breakpoint: the full 4-token blocks are what this request leaves cached.
    assert (u.cache_read_input_tokens, u.cache_creation_input_tokens) == (0, total // 4 * 4)
    assert u.input_tokens == total - total // 4 * 4


def test_a_breakpoint_creates_up_to_itself_and_the_next_call_reads_it(
    sdk: anthropic.Anthropic, http: TestClient, engine: FakeEngine
) -> None:
    first = ask(sdk, system=cached_system())
    total = len(engine.calls[-1].prompt_token_ids)
    upto = HEAD + len(SYSTEM)  # "<|im_start|>system\n" + the system text
    assert first.usage.cache_read_input_tokens == 0
    assert first.usage.cache_creation_input_tokens == upto
    assert first.usage.input_tokens == total - upto
    second = ask(sdk, system=cached_system(), messages=[{"role": "user", "content": "and now?"}])
    total2 = len(engine.calls[-1].prompt_token_ids)
    read = second.usage.cache_read_input_tokens
    assert upto // 4 * 4 <= read < total2  # the fake reads whole blocks, shared up to the user text
    assert second.usage.cache_creation_input_tokens == 0
    assert second.usage.input_tokens == total2 - read
    # OpenAI's definition counts the cached tokens in prompt_tokens: the same prompt through chat.
    chat = http.post(
        "/v1/chat/completions",
        headers={"Authorization": f"Bearer {KEY}"},
        json={
            "model": MODEL,
            "max_tokens": 6,
            "messages": [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "and now?"}],
        },
    ).json()
    assert chat["usage"]["prompt_tokens"] == total2
    assert chat["usage"]["prompt_tokens_details"]["cached_tokens"] >= read


def test_another_salt_reads_nothing(http: TestClient, sdk: anthropic.Anthropic) -> None:
    ask(sdk, system=cached_system(), extra_body={"cache_salt": "tenant-a"})
    again = ask(sdk, system=cached_system(), extra_body={"cache_salt": "tenant-a"})
    other = ask(sdk, system=cached_system(), extra_body={"cache_salt": "tenant-b"})
    assert again.usage.cache_read_input_tokens > 0
    assert other.usage.cache_read_input_tokens == 0 and other.usage.cache_creation_input_tokens > 0


def test_breakpoints_on_messages_tools_and_ttl(sdk: anthropic.Anthropic, engine: FakeEngine) -> None:
    user = [{"type": "text", "text": "first part"}, {"type": "text", "text": "second", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]  # fmt: skip
    msg = ask(sdk, system=SYSTEM, messages=[{"role": "user", "content": user}])
    rendered = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nfirst part\nsecond"
    upto = len(engine.tokenizer.encode(rendered))
    assert msg.usage.cache_creation_input_tokens == upto
    assert msg.usage.input_tokens == len(engine.calls[-1].prompt_token_ids) - upto
    # A tool's breakpoint ends before the system text (the fake template does not render tools). Another
    # salt: the template's head is in the cache already, and what was read is not created again.
    tool = {"name": "f", "input_schema": {"type": "object"}, "cache_control": {"type": "ephemeral"}}
    msg = ask(sdk, system=SYSTEM, tools=[tool], tool_choice={"type": "none"}, extra_body={"cache_salt": "s"})
    assert (msg.usage.cache_read_input_tokens, msg.usage.cache_creation_input_tokens) == (0, HEAD)
    msg = ask(
        sdk, system=SYSTEM, tools=[tool], tool_choice={"type": "none"}
    )  # the first call's system is read
    assert msg.usage.cache_read_input_tokens > HEAD and msg.usage.cache_creation_input_tokens == 0
    assert engine.calls[-1].prompt_token_ids  # tools with tool_choice none: a plain answer
    assert [b.type for b in msg.content] == ["text"]


def test_without_prefix_caching_nothing_is_created() -> None:
    engine = FakeEngine(model_name=MODEL, enable_prefix_caching=False)
    with TestClient(create_app(engine)) as http:
        body = {"model": MODEL, "max_tokens": 4, "system": cached_system(), "messages": [{"role": "user", "content": "x"}]}  # fmt: skip
        usage = http.post("/v1/messages", json=body).json()["usage"]
    assert usage["cache_creation_input_tokens"] == usage["cache_read_input_tokens"] == 0
    assert usage["input_tokens"] == len(engine.calls[-1].prompt_token_ids)


def test_the_stream_events_and_the_sdk_helper(sdk: anthropic.Anthropic, http: TestClient) -> None:
    with sdk.messages.stream(model=MODEL, max_tokens=8, system=SYSTEM, messages=[{"role": "user", "content": "hi"}]) as s:  # fmt: skip
        text = "".join(s.text_stream)
        final = s.get_final_message()
    assert final.content[0].type == "text" and final.content[0].text == text and text
    assert final.stop_reason == "max_tokens" and final.usage.output_tokens == 8
    body = {"model": MODEL, "max_tokens": 3, "stream": True, "messages": [{"role": "user", "content": "hi"}]}
    r = http.post("/v1/messages", json=body, headers={"x-api-key": KEY})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [block.split("\n")[0].removeprefix("event: ") for block in r.text.strip().split("\n\n")]
    assert events[:4] == ["message_start", "ping", "content_block_start", "content_block_delta"]
    assert events[-3:] == ["content_block_stop", "message_delta", "message_stop"]
    assert "[DONE]" not in r.text


def test_stop_reasons(sdk: anthropic.Anthropic, engine: FakeEngine) -> None:
    # Greedy, so the fake's words are the same every run (sampled, 40 characters of its words without an "o"
    # came up about once in 600 runs).
    msg = ask(sdk, max_tokens=40, stop_sequences=["zz", "o"], extra_body={"temperature": 0.0})
    assert engine.calls[-1].params.greedy
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "o"
    engine.eos_after = 3
    assert ask(sdk).stop_reason == "end_turn"


def test_a_named_tool_streams_its_input_and_any_parses_the_call(http: TestClient, engine: FakeEngine) -> None:
    tool = {
        "name": "get_weather",
        "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}},
    }
    body = {"model": MODEL, "max_tokens": 5, "tools": [tool], "tool_choice": {"type": "tool", "name": "get_weather"},
            "messages": [{"role": "user", "content": "Paris?"}], "stream": True}  # fmt: skip
    r = http.post("/v1/messages", json=body)
    assert '"content_block":{"type":"tool_use"' in r.text and '"name":"get_weather","input":{}' in r.text
    assert '"type":"input_json_delta"' in r.text
    # The engine got the tool's schema as the output constraint (the fake does not apply it).
    structured = engine.calls[-1].params.structured
    assert structured is not None and '"city"' in structured.spec
    whole = http.post("/v1/messages", json={**body, "stream": False}).json()
    assert whole["content"][0]["type"] == "tool_use" and whole["content"][0]["input"] == {}
    assert whole["stop_reason"] == "max_tokens"  # cut short: the input is not whole


def test_the_conversation_becomes_chat_messages(http: TestClient, engine: FakeEngine) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Let me look."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "sunny"}]},
                                     {"type": "text", "text": "Thanks. So?"}]},
        {"role": "assistant", "content": "It is"},
    ]  # fmt: skip
    body = {"model": MODEL, "max_tokens": 2, "system": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}],
            "messages": messages, "metadata": {"user_id": "u1"}}  # fmt: skip
    assert http.post("/v1/messages", json=body).status_code == 200
    seen = engine.tokenizer.template_calls[-1]
    assert seen["add_generation_prompt"] is False  # an assistant message last is continued
    assert [m["role"] for m in seen["messages"]] == [
        "system",
        "user",
        "assistant",
        "tool",
        "user",
        "assistant",
    ]
    assert seen["messages"][0]["content"] == "a\nb"
    call = seen["messages"][2]["tool_calls"][0]
    assert call["id"] == "toolu_1" and call["function"] == {"name": "w", "arguments": {"city": "Paris"}}
    assert seen["messages"][3] == {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"}
    assert engine.calls[-1].prompt_token_ids[-len("It is") :] == engine.tokenizer.encode("It is")


@pytest.mark.parametrize(
    ("headers", "status"),
    [
        ({"x-api-key": KEY, "anthropic-version": "2023-06-01"}, 200),
        ({"Authorization": f"Bearer {KEY}", "anthropic-version": "whatever"}, 200),
        ({"x-api-key": "wrong"}, 401),
        ({}, 401),
    ],
)
def test_auth_by_x_api_key_or_bearer(engine: FakeEngine, headers: dict[str, str], status: int) -> None:
    with TestClient(create_app(engine, api_keys=[KEY])) as http:
        body = {"model": MODEL, "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
        r = http.post("/v1/messages", json=body, headers=headers)
    assert r.status_code == status
    if status == 401:
        assert r.json()["type"] == "error" and r.json()["error"]["type"] == "authentication_error"


def test_a_tenant_key_reaches_messages_in_its_namespace(engine: FakeEngine) -> None:
    tenancy = TenancyConfig(tenants={key_hash("sk-acme"): "acme"})
    with TestClient(create_app(engine, api_keys=[KEY], tenancy=tenancy)) as http:
        body = {
            "model": MODEL,
            "max_tokens": 2,
            "messages": [{"role": "user", "content": "hi"}],
            "cache_salt": "u",
        }
        assert http.post("/v1/messages", json=body, headers={"x-api-key": "sk-acme"}).status_code == 200
        assert engine.calls[-1].namespace == CacheNamespace(tenant="acme", salt="u")
        r = http.post("/v1/messages/count_tokens", json=body, headers={"x-api-key": "sk-acme"})
        assert r.status_code == 200 and r.json()["input_tokens"] == len(engine.calls[-1].prompt_token_ids)


def test_top_level_cache_control_marks_the_last_block(sdk: anthropic.Anthropic, engine: FakeEngine) -> None:
    msg = ask(sdk, system=SYSTEM, messages=[{"role": "user", "content": "the question"}], cache_control={"type": "ephemeral"})  # fmt: skip
    rendered = f"<|im_start|>system\n{SYSTEM}<|im_end|>\n<|im_start|>user\nthe question"
    assert msg.usage.cache_creation_input_tokens == len(engine.tokenizer.encode(rendered))
    assert msg.usage.input_tokens == len(engine.tokenizer.encode("<|im_end|>\n<|im_start|>assistant\n"))
