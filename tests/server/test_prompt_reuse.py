"""Generation prompts are tokenized with piece reuse in the request's own cache namespace (engine/piece_cache.py),
so a tenant's repeated document is tokenized once and never found by another namespace; the other routes that
tokenize (/tokenize) keep nothing."""

from __future__ import annotations

from typing import Any

import pytest
from fastapi.testclient import TestClient

from kv_cache.namespace import CacheNamespace
from tests.server.fake_engine import FakeEngine
from tests.server.server_helpers import MODEL, chat_body, completion_body


@pytest.fixture
def calls(engine: FakeEngine, monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    seen: list[dict[str, Any]] = []
    inner = engine.tokenizer.encode

    def encode(text: str, add_special_tokens: bool = True, **kw: Any) -> list[int]:
        if "some text" in text:  # the prompt's (the fake engine tokenizes other text too)
            seen.append(kw)
        return inner(text, add_special_tokens)

    monkeypatch.setattr(engine.tokenizer, "encode", encode)
    return seen


@pytest.mark.parametrize("route", ["/v1/completions", "/v1/chat/completions"])
def test_a_generation_prompt_is_reused_within_its_own_namespace(
    client: TestClient, calls: list[dict[str, Any]], route: str
) -> None:
    make = completion_body if route == "/v1/completions" else chat_body
    assert client.post(route, json=make("some text", cache_salt="s1")).status_code == 200
    assert client.post(route, json=make("some text")).status_code == 200
    assert calls == [  # limit: the context length (the fake engine's 256), past which tokenizing stops
        {"reuse": True, "namespace": CacheNamespace(salt="s1"), "limit": 256},
        {"reuse": True, "namespace": None, "limit": 256},
    ]


def test_tokenize_keeps_nothing(client: TestClient, calls: list[dict[str, Any]]) -> None:
    assert client.post("/tokenize", json={"model": MODEL, "prompt": "some text"}).status_code == 200
    assert len(calls) == 1 and not calls[0].get("reuse")
