"""OpenAI clients send `null` for optional fields they do not set (`stop: null`, `max_tokens: null`, ...):
null must mean "the default", exactly as if the field were absent, never a 400 and never a different
request."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import MODEL

from server.protocol import ChatCompletionRequest, CompletionRequest, TokenizeRequest

CHAT_MESSAGES = [{"role": "user", "content": "hi"}]


def _all_null(model: type, required: set[str]) -> dict[str, None]:
    # cache_salt is the one exception: a null salt is refused, not read as "no salt" (test_server_auth_salt).
    return {name: None for name in model.model_fields if name not in required | {"cache_salt"}}


@pytest.mark.parametrize(
    ("path", "model", "base"),
    [
        ("/v1/chat/completions", ChatCompletionRequest, {"messages": CHAT_MESSAGES}),
        ("/v1/completions", CompletionRequest, {"prompt": "hello"}),
    ],
)
def test_null_means_default(
    client: TestClient, engine: FakeEngine, path: str, model: type, base: dict
) -> None:
    nulls = _all_null(model, set(base))
    openai_nullable = {"stop", "max_tokens", "temperature", "seed", "logprobs", "n", "stream_options", "user"}
    assert openai_nullable <= set(nulls)
    for stream in (False, True):
        absent = client.post(path, json={**base, "model": MODEL, "stream": stream, "temperature": 0})
        null = client.post(path, json={**base, **nulls, "model": MODEL, "stream": stream, "temperature": 0})
        assert absent.status_code == null.status_code == 200, null.text
        want, got = engine.calls[-2], engine.calls[-1]
        assert got.prompt_token_ids == want.prompt_token_ids
        assert got.params == want.params


def test_null_means_default_on_tokenize(client: TestClient) -> None:
    nulls = _all_null(TokenizeRequest, {"prompt", "messages"})
    for base in ({"prompt": "hello"}, {"messages": CHAT_MESSAGES}):
        absent = client.post("/tokenize", json=base)
        null = client.post("/tokenize", json={**base, **nulls})
        assert absent.status_code == null.status_code == 200, null.text
        assert null.json() == absent.json()
