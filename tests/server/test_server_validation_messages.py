"""Request validation, exactly: each refusal's whole error object (message, type, param, code), the
boundaries that are still accepted, and the `SamplingParams` an absent or null field turns into. The other
server tests check status and param; `make mutate` showed that a changed message or an off-by-one bound
passed them all.
"""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import MODEL, chat_body, completion_body, http_scope

from engine.sampling_params import SamplingParams

CHAT, COMPLETIONS = "/v1/chat/completions", "/v1/completions"
TOOLS = [{"type": "function", "function": {"name": "f"}}]
FUNCTIONS = [{"name": "f"}]
USER, ASSISTANT, SYSTEM = (
    {"role": "user", "content": "hi"},
    {"role": "assistant", "content": "so"},
    {"role": "system", "content": "be brief"},
)
CONTEXT = "context_length_exceeded"

REFUSED: list[tuple[str, dict[str, Any], str, str | None, str | None]] = [
    (
        CHAT,
        chat_body(tools=TOOLS),
        'tool_choice "auto" is not supported: this model\'s chat template has no tool-call format. Send '
        'tool_choice "required" or {"type": "function", "function": {"name": ...}} to force a call, or "none".',
        "tool_choice",
        None,
    ),
    (
        CHAT,
        chat_body(tools=TOOLS, tool_choice={"type": "function", "function": {"name": "g"}}),
        "tool_choice names function 'g', which is not in tools.",
        "tool_choice",
        None,
    ),
    (CHAT, chat_body(functions=FUNCTIONS), "Function calling is not supported.", "functions", None),
    (
        CHAT,
        chat_body(response_format={"type": "json_schema", "json_schema": {"name": "x"}}),
        'response_format type "json_schema" needs json_schema.schema (and a name).',
        "response_format",
        None,
    ),
    (
        CHAT,
        chat_body(guided_regex="a", guided_choice=["a"]),
        "Only one output constraint may be given; got guided_regex, guided_choice.",
        "guided_choice",
        None,
    ),
    (CHAT, chat_body(top_logprobs=2), "top_logprobs requires logprobs to be true.", "top_logprobs", None),
    (
        CHAT,
        chat_body(messages=[USER, ASSISTANT], add_generation_prompt=True, continue_final_message=True),
        "add_generation_prompt and continue_final_message cannot both be true.",
        "continue_final_message",
        None,
    ),
    (
        CHAT,
        chat_body(messages=[USER, ASSISTANT, USER], add_generation_prompt=False, continue_final_message=True),
        "continue_final_message needs an assistant message last.",
        "continue_final_message",
        None,
    ),
    (COMPLETIONS, completion_body(suffix="!"), "suffix is not supported.", "suffix", None),
    (COMPLETIONS, completion_body(logit_bias={"5": 1}), "logit_bias is not supported.", "logit_bias", None),
    (CHAT, chat_body(logit_bias={"5": 1}), "logit_bias is not supported.", "logit_bias", None),
    (
        COMPLETIONS,
        completion_body(stop_token_ids=[-1]),
        "stop_token_ids contains a token id outside the vocabulary.",
        "stop_token_ids",
        None,
    ),
    (COMPLETIONS, completion_body(max_tokens=0), "max_tokens must be at least 1.", "max_tokens", None),
    (
        CHAT,
        chat_body(max_completion_tokens=0),
        "max_completion_tokens must be at least 1.",
        "max_completion_tokens",
        None,
    ),
    (COMPLETIONS, completion_body(""), "The prompt must contain at least one token.", "prompt", None),
    (
        COMPLETIONS,
        completion_body([1] * 250, max_tokens=10),
        "This model's maximum context length is 256 tokens. However, you requested 260 tokens (250 in the "
        "input, 10 in the completion). Please reduce the length of the input or of max_tokens.",
        "prompt",
        CONTEXT,
    ),
    (
        COMPLETIONS,
        completion_body(max_tokens=4, min_tokens=5),
        "min_tokens must not exceed the maximum number of tokens.",
        "min_tokens",
        None,
    ),
]


@pytest.mark.parametrize(("path", "body", "message", "param", "code"), REFUSED, ids=lambda v: str(v)[:40])
def test_each_refusal_says_exactly_what_is_wrong(
    client: TestClient,
    engine: FakeEngine,
    path: str,
    body: dict,
    message: str,
    param: str | None,
    code: str | None,
) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 400, r.text
    assert r.json() == {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    }
    assert engine.calls == []


def _chat_of(client: TestClient, num_tokens: int) -> dict[str, Any]:
    """A chat body (no max_tokens: all the room left) whose rendered prompt is exactly num_tokens long."""

    def count(content: str) -> int:
        return client.post("/tokenize", json={"messages": [{"role": "user", "content": content}]}).json()[
            "count"
        ]

    content = "x" * (num_tokens - count(""))
    assert count(content) == num_tokens
    return {"model": MODEL, "messages": [{"role": "user", "content": content}]}


def test_a_prompt_that_leaves_no_room_is_refused_and_one_that_leaves_one_token_is_not(
    client: TestClient,
) -> None:
    r = client.post(CHAT, json=_chat_of(client, 256))
    assert r.status_code == 400
    assert r.json()["error"] == {
        "message": "This model's maximum context length is 256 tokens. However, your request has 256 input "
        "tokens, which leaves no room for output.",
        "type": "invalid_request_error",
        "param": "messages",
        "code": CONTEXT,
    }
    r = client.post(CHAT, json=_chat_of(client, 255))
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 1


ACCEPTED = [
    (CHAT, chat_body(functions=FUNCTIONS, function_call="none")),
    (CHAT, chat_body(tools=TOOLS, tool_choice="none")),
    (
        CHAT,
        chat_body(
            messages=[SYSTEM, USER, ASSISTANT], add_generation_prompt=False, continue_final_message=True
        ),
    ),
    (
        COMPLETIONS,
        completion_body(stop_token_ids=[0, 255]),
    ),  # the first and the last token id of the vocabulary
    (COMPLETIONS, completion_body(max_tokens=1)),
    (COMPLETIONS, completion_body(max_tokens=3, min_tokens=3)),
    (COMPLETIONS, completion_body([1] * 250, max_tokens=6)),
]


@pytest.mark.parametrize(("path", "body"), ACCEPTED, ids=lambda v: str(v)[:40])
def test_boundaries_that_are_still_accepted(client: TestClient, path: str, body: dict) -> None:
    r = client.post(path, json=body)
    assert r.status_code == 200, r.text


def test_stop_token_ids_past_the_vocabulary_are_refused(client: TestClient, engine: FakeEngine) -> None:
    vocab = engine.tokenizer.vocab_size
    assert client.post(COMPLETIONS, json=completion_body(stop_token_ids=[vocab - 1])).status_code == 200
    r = client.post(COMPLETIONS, json=completion_body(stop_token_ids=[vocab]))
    assert r.status_code == 400 and r.json()["error"]["param"] == "stop_token_ids"


@pytest.mark.parametrize("fill", ["absent", "null"])
def test_unset_sampling_fields_become_the_engine_defaults(
    client: TestClient, engine: FakeEngine, fill: str
) -> None:
    fields = (
        "n",
        "top_k",
        "min_p",
        "presence_penalty",
        "frequency_penalty",
        "repetition_penalty",
        "min_tokens",
        "top_p",
    )
    extra = {f: None for f in fields} if fill == "null" else {}
    for path, body in ((CHAT, chat_body(**extra)), (COMPLETIONS, completion_body(**extra))):
        assert client.post(path, json={**body, "temperature": 0.5}).status_code == 200
        assert engine.calls[-1].params == SamplingParams(max_tokens=8, temperature=0.5)


def test_logprobs_reach_the_engine_as_asked(client: TestClient, engine: FakeEngine) -> None:
    client.post(CHAT, json=chat_body(logprobs=True))
    assert engine.calls[-1].params.logprobs == 0  # the chosen token only, no alternatives
    client.post(CHAT, json=chat_body(logprobs=True, top_logprobs=3))
    assert engine.calls[-1].params.logprobs == 3
    client.post(COMPLETIONS, json=completion_body(logprobs=2))
    params = engine.calls[-1].params
    assert params.logprobs == 2 and params.prompt_logprobs is None  # prompt logprobs only with echo
    client.post(COMPLETIONS, json=completion_body(logprobs=2, echo=True))
    assert engine.calls[-1].params.prompt_logprobs == 2
    assert MODEL


BAD_BODIES = [
    (b"{not json", "We could not parse the JSON body of your request.", None, "invalid_json"),
    (
        b"[1, 2]",
        "The request body must be a JSON object (sent with Content-Type: application/json).",
        None,
        "invalid_json",
    ),
    (
        b'{"prompt": "x", "cache_salt": 5}',
        "cache_salt: Input should be a valid string",
        "cache_salt",
        "invalid_cache_salt",
    ),
    (
        b'{"prompt": "x", "cache_salt": ""}',
        "cache_salt: String should have at least 1 character",
        "cache_salt",
        "invalid_cache_salt",
    ),
    (
        b'{"prompt": "x", "cache_salt": "' + b"s" * 1025 + b'"}',
        "cache_salt: String should have at most 1024 characters",
        "cache_salt",
        "invalid_cache_salt",
    ),
]


@pytest.mark.parametrize(("raw", "message", "param", "code"), BAD_BODIES, ids=lambda v: str(v)[:30])
def test_each_bad_body_says_exactly_what_is_wrong(
    client: TestClient, raw: bytes, message: str, param: str | None, code: str
) -> None:
    r = client.post(COMPLETIONS, content=raw, headers={"content-type": "application/json"})
    assert r.status_code == 400
    assert r.json() == {
        "error": {"message": message, "type": "invalid_request_error", "param": param, "code": code}
    }


def test_the_body_limit_is_inclusive_and_counts_every_chunk(engine: FakeEngine) -> None:
    from server.app import create_app

    client = TestClient(create_app(engine, max_body_bytes=1000))
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": 2, "user": "' % MODEL.encode()
    exact = body + b"u" * (1000 - len(body) - 2) + b'"}'
    assert len(exact) == 1000
    assert client.post(COMPLETIONS, content=exact).status_code == 200  # declared length == limit: fine
    assert client.post(COMPLETIONS, content=iter([exact])).status_code == 200  # streamed, no length
    too_large = {
        "error": {
            "message": "The request body is larger than the 1000 bytes this server accepts.",
            "type": "invalid_request_error",
            "param": None,
            "code": "request_too_large",
        }
    }
    r = client.post(COMPLETIONS, content=exact + b" ")
    assert r.status_code == 413 and r.json() == too_large

    # Chunked, no Content-Length: two chunks each under the limit, together over it (straight over ASGI:
    # the test client would join them into one).
    status, payload = asyncio.run(
        _asgi_post(create_app(engine, max_body_bytes=1000), [exact[:600], exact[600:] + b" "])
    )
    assert status == 413 and json.loads(payload) == too_large


def test_only_bodies_of_post_put_and_patch_are_capped(engine: FakeEngine) -> None:
    from server.app import create_app

    client = TestClient(create_app(engine, max_body_bytes=10))
    # A GET's body is never read, so it is never refused (the route ignores it).
    assert client.request("GET", "/v1/models", content=b"x" * 100).status_code == 200


def test_a_request_message_without_a_body_key_counts_as_empty(engine: FakeEngine) -> None:
    # ASGI makes "body" optional (default b""): a server may send the last message without one.
    from server.app import create_app

    app = create_app(engine, max_body_bytes=1000)
    body = b'{"model": "%s", "prompt": "hi", "max_tokens": 2}' % MODEL.encode()
    messages = [{"type": "http.request", "body": body, "more_body": True}, {"type": "http.request"}]
    sent: list[dict] = []

    async def receive() -> dict:
        if not messages:
            await asyncio.Event().wait()  # the client stays until the answer is sent
        return messages.pop(0)

    async def send(message: dict) -> None:
        sent.append(message)

    scope = http_scope("POST", COMPLETIONS, [(b"content-type", b"application/json")])
    asyncio.run(app(scope, receive, send))
    assert sent[0]["status"] == 200
    assert json.loads(b"".join(m.get("body", b"") for m in sent[1:]))["usage"]["prompt_tokens"] > 0


async def _asgi_post(app, chunks: list[bytes], headers: list[tuple[bytes, bytes]] = ()) -> tuple[int, bytes]:
    messages = [
        {"type": "http.request", "body": c, "more_body": i < len(chunks) - 1} for i, c in enumerate(chunks)
    ]
    sent: list[dict] = []

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        sent.append(message)

    scope = http_scope("POST", COMPLETIONS, [(b"content-type", b"application/json"), *headers])
    await app(scope, receive, send)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_an_unknown_model_is_named_but_a_long_name_is_cut(client: TestClient) -> None:
    for name, shown in (("m" * 100, "m" * 100), ("m" * 101, "m" * 100 + "...")):
        r = client.post(COMPLETIONS, json=completion_body(model=name))
        assert r.status_code == 404
        assert r.json()["error"] == {
            "message": f"The model `{shown}` does not exist.",
            "type": "invalid_request_error",
            "param": "model",
            "code": "model_not_found",
        }


def test_an_absurdly_long_declared_length_is_a_413_not_a_crash(engine: FakeEngine) -> None:
    from server.app import create_app

    # Python refuses int() of more than 4300 digits: the length check must never get that far.
    app = create_app(engine, max_body_bytes=1000)
    status, _ = asyncio.run(_asgi_post(app, [b"{}"], [(b"content-length", b"9" * 5000)]))
    assert status == 413
