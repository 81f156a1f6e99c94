"""Chat completions through the official SDK against the real server and model."""

from __future__ import annotations

import asyncio
import uuid

import openai
import pytest
from e2e_server import BrineServer

pytestmark = pytest.mark.slow

QUESTION = [{"role": "user", "content": "Name three colours of the rainbow."}]


def _fresh_salt() -> str:
    # A salt never used before makes the request compute its whole prompt (no prefix-cache hit), so two
    # requests compared token for token run exactly the same computation.
    return f"e2e-{uuid.uuid4().hex}"


def test_streamed_text_equals_non_streamed(client: openai.OpenAI, brine_server: BrineServer) -> None:
    kwargs = {"model": brine_server.model, "messages": QUESTION, "max_tokens": 12, "temperature": 0}
    full = client.chat.completions.create(**kwargs, extra_body={"cache_salt": _fresh_salt()})
    [choice] = full.choices
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert full.usage is not None and full.usage.completion_tokens <= 12
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens
    assert full.usage.prompt_tokens_details is not None
    assert full.usage.prompt_tokens_details.cached_tokens == 0

    stream = client.chat.completions.create(
        **kwargs,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"cache_salt": _fresh_salt()},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    assert text == choice.message.content
    assert finishes == [choice.finish_reason]
    usage = chunks[-1]
    assert usage.choices == [] and usage.usage is not None
    assert usage.usage.completion_tokens == full.usage.completion_tokens
    assert usage.usage.prompt_tokens == full.usage.prompt_tokens
    assert len({c.id for c in chunks}) == 1


def test_max_tokens_gives_length(client: openai.OpenAI, brine_server: BrineServer) -> None:
    r = client.chat.completions.create(
        model=brine_server.model, messages=QUESTION, max_completion_tokens=3, temperature=0
    )
    assert r.choices[0].finish_reason == "length" and r.usage is not None and r.usage.completion_tokens == 3


def test_n2(client: openai.OpenAI, brine_server: BrineServer) -> None:
    kwargs = {"model": brine_server.model, "messages": QUESTION, "max_tokens": 5, "logprobs": True}
    seeded = [client.chat.completions.create(**kwargs, temperature=0.8, seed=1, n=2) for _ in range(2)]
    for r in seeded:
        assert [c.index for c in r.choices] == [0, 1]
        assert all(c.message.content is not None and c.logprobs and c.logprobs.content for c in r.choices)
        # usage counts the tokens of both choices; a choice cut by max_tokens has exactly 5.
        lengths = [len(c.logprobs.content or []) for c in r.choices]
        assert r.usage is not None and r.usage.completion_tokens == sum(lengths)
        assert all(n == 5 for n, c in zip(lengths, r.choices, strict=True) if c.finish_reason == "length")
    # A seed makes the n samples reproducible, choice by choice.
    assert [c.message.content for c in seeded[0].choices] == [c.message.content for c in seeded[1].choices]
    # Greedy: every one of the n choices is the single greedy answer.
    greedy = client.chat.completions.create(**kwargs, temperature=0, n=2)
    alone = client.chat.completions.create(**kwargs, temperature=0)
    assert [c.message.content for c in greedy.choices] == [alone.choices[0].message.content] * 2


def test_stop_string(client: openai.OpenAI, brine_server: BrineServer) -> None:
    kwargs = {"model": brine_server.model, "messages": QUESTION, "max_tokens": 16, "temperature": 0}
    full = client.chat.completions.create(**kwargs).choices[0].message.content or ""
    words = full.split()
    assert len(words) >= 3, full
    stop = " " + words[2]
    r = client.chat.completions.create(**kwargs, stop=[stop, "never-appears-xyz"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[: full.index(stop)]


def test_logprobs(client: openai.OpenAI, brine_server: BrineServer) -> None:
    r = client.chat.completions.create(
        model=brine_server.model,
        messages=QUESTION,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
    )
    choice = r.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    content = choice.logprobs.content
    assert r.usage is not None and len(content) == r.usage.completion_tokens
    for tok in content:
        assert tok.logprob <= 0 and len(tok.top_logprobs) == 3
        assert tok.bytes == list(tok.token.encode())
        # Greedy: the chosen token is the most likely one.
        assert tok.top_logprobs[0].token == tok.token
        assert tok.top_logprobs[0].logprob == pytest.approx(tok.logprob, abs=1e-4)
    if choice.finish_reason == "length":
        assert "".join(t.token for t in content) == choice.message.content


async def test_async_client_concurrent_requests(
    async_client: openai.AsyncOpenAI, brine_server: BrineServer
) -> None:
    prompts = ["Say yes.", "Say no.", "Say maybe."]

    async def one(prompt: str) -> str:
        r = await async_client.chat.completions.create(
            model=brine_server.model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=4,
            temperature=0,
        )
        return r.choices[0].message.content or ""

    async def streamed(prompt: str) -> str:
        stream = await async_client.chat.completions.create(
            model=brine_server.model,
            messages=[{"role": "user", "content": prompt}],
            max_tokens=4,
            temperature=0,
            stream=True,
        )
        return "".join([c.choices[0].delta.content or "" async for c in stream if c.choices])

    together = await asyncio.gather(*(one(p) for p in prompts), *(streamed(p) for p in prompts))
    alone = [await one(p) for p in prompts]
    # Greedy, so batching must not change an answer (batch invariance): each request, plain or streamed,
    # gets the very text it gets alone, and none comes back empty.
    assert together == alone + alone and all(alone)
