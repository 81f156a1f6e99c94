"""Errors through the SDK: the right exception classes, codes and params; auth on every route but /health."""

from __future__ import annotations

import httpx
import openai
import pytest
from e2e_server import BrineServer, make_client

pytestmark = pytest.mark.slow

HI = [{"role": "user", "content": "Hi"}]


def test_wrong_key_is_401(brine_server: BrineServer) -> None:
    bad = make_client(brine_server, api_key="not-the-key")
    with pytest.raises(openai.AuthenticationError) as exc:
        bad.chat.completions.create(model=brine_server.model, messages=HI, max_tokens=2)
    assert exc.value.status_code == 401 and exc.value.code == "invalid_api_key"
    with pytest.raises(openai.AuthenticationError):
        bad.models.list()


def test_every_route_but_health_needs_the_key(brine_server: BrineServer) -> None:
    base = brine_server.base_url
    assert httpx.get(f"{base}/health", timeout=10).status_code == 200
    for method, path in (
        ("GET", "/metrics"), ("GET", "/v1/models"), ("GET", "/version"), ("POST", "/tokenize"),
        ("POST", "/detokenize"), ("POST", "/reset_prefix_cache"), ("POST", "/v1/completions"),
    ):  # fmt: skip
        r = httpx.request(method, f"{base}{path}", json={}, timeout=10)
        assert r.status_code == 401, (path, r.text)
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(f"{base}/metrics", headers=brine_server.headers, timeout=10).status_code == 200


def test_unknown_model_is_404(client: openai.OpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as exc:
        client.chat.completions.create(model="no-such-model", messages=HI, max_tokens=2)
    assert exc.value.code == "model_not_found" and exc.value.param == "model"
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="no-such-model", prompt="Hi", max_tokens=2)


def test_context_length(client: openai.OpenAI, brine_server: BrineServer) -> None:
    for call in (
        lambda: client.chat.completions.create(model=brine_server.model, messages=HI, max_tokens=10**6),
        lambda: client.completions.create(model=brine_server.model, prompt="Hi", max_tokens=10**6),
        lambda: client.completions.create(
            model=brine_server.model, prompt="Hi", max_tokens=10**6, stream=True
        ),
    ):
        with pytest.raises(openai.BadRequestError) as exc:
            call()
        assert exc.value.code == "context_length_exceeded"
        assert "maximum context length" in exc.value.message


def test_tool_choice_auto_is_refused(client: openai.OpenAI, brine_server: BrineServer) -> None:
    # The default model's template has no tool-call format, so "auto" (the default with tools) cannot work;
    # forced calls are tested in test_e2e_structured.
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=brine_server.model, messages=HI, max_tokens=2, tools=tools)
    assert exc.value.param == "tool_choice"
    r = client.chat.completions.create(
        model=brine_server.model, messages=HI, max_tokens=2, tools=tools, tool_choice="none"
    )
    assert r.choices[0].message.content is not None


def test_validation_errors_are_400(client: openai.OpenAI, brine_server: BrineServer) -> None:
    with pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(model=brine_server.model, messages=HI, max_tokens=2, temperature=7)
    assert exc.value.param == "temperature"
    r = httpx.post(
        f"{brine_server.base_url}/v1/completions",
        content=b"{oops",
        headers={**brine_server.headers, "content-type": "application/json"},
        timeout=10,
    )
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    r = httpx.get(f"{brine_server.base_url}/v1/nowhere", headers=brine_server.headers, timeout=10)
    assert r.status_code == 404 and set(r.json()["error"]) == {"message", "type", "param", "code"}
