"""Extreme but valid sampling settings must not produce a 5xx or kill the engine (a runner exception is fatal
to every tenant, so the server has to keep such input away from it or the engine has to cope)."""

from __future__ import annotations

import httpx
import openai
import pytest
from e2e_server import BrineServer

pytestmark = pytest.mark.slow

CASES = [
    {"top_k": 10**9},
    {"top_k": 1, "temperature": 2},
    {"repetition_penalty": 1e30},
    {"repetition_penalty": 1e-30},
    {"temperature": 2e-5, "top_p": 1e-9},
    {"min_p": 1.0, "temperature": 1.5},
    {"seed": 2**63 - 1, "n": 2, "temperature": 1},
    {"seed": -(2**63), "temperature": 1},
    {"presence_penalty": -2, "frequency_penalty": 2, "temperature": 1.3},
    {"logprobs": 20, "echo": True, "temperature": 0},
    {"min_tokens": 3, "ignore_eos": True, "stop_token_ids": [0, 1, 2]},
    {"stop": ["", "\n", " "]},
    {"prompt": [0, 1, 2, 0]},
    {"n": 8, "temperature": 1},
]


@pytest.mark.parametrize("extra", CASES, ids=lambda e: ",".join(e))
def test_extreme_settings(brine_server: BrineServer, extra: dict) -> None:
    body = {"model": brine_server.model, "prompt": "Once upon a time", "max_tokens": 3, **extra}
    r = httpx.post(
        f"{brine_server.base_url}/v1/completions", json=body, headers=brine_server.headers, timeout=120
    )
    assert r.status_code < 500, r.text
    health = httpx.get(f"{brine_server.base_url}/health", timeout=10)
    assert health.status_code == 200, brine_server.log_tail()


def test_sdk_nulls_mean_defaults(client: openai.OpenAI, brine_server: BrineServer) -> None:
    # The SDK sends an explicit None as JSON null; OpenAI reads null as "the default".
    nulls = {"stop": None, "temperature": None, "seed": None, "logprobs": None, "n": None, "user": None}
    chat = client.chat.completions.create(
        model=brine_server.model,
        messages=[{"role": "user", "content": "Hi"}],
        max_tokens=None,
        max_completion_tokens=3,
        top_logprobs=None,
        stream_options=None,
        response_format=None,
        **nulls,
    )
    assert len(chat.choices) == 1 and chat.usage is not None and chat.usage.completion_tokens <= 3
    # Completions' default max_tokens is 16, null included (not "up to the context length").
    text = client.completions.create(
        model=brine_server.model, prompt="Once upon a time", max_tokens=None, echo=None, **nulls
    )
    assert text.usage is not None and text.usage.completion_tokens <= 16


def test_oversized_body_and_request_template_are_refused(brine_server: BrineServer) -> None:
    url = f"{brine_server.base_url}/v1/chat/completions"
    raw = b'{"messages": [{"role": "user", "content": "Hi"}]' + b" " * (17 * 2**20) + b"}"
    r = httpx.post(url, content=raw, headers={**brine_server.headers, "content-type": "application/json"})
    assert r.status_code == 413 and r.json()["error"]["code"] == "request_too_large"
    body = {
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 1,
        "chat_template_kwargs": {"chat_template": "{% for i in range(99999) %}{{ i }}{% endfor %}"},
    }
    r = httpx.post(url, json=body, headers=brine_server.headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template_kwargs"
    # vLLM's top-level field too: refused, not silently ignored with a 200 (the client would think it was used).
    top = {"messages": body["messages"], "max_tokens": 1, "chat_template": "{{ messages }}"}
    r = httpx.post(url, json=top, headers=brine_server.headers, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "chat_template"
