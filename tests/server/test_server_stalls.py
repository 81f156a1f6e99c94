"""Work that must not run on the event loop, and its bounds: `/detokenize` decodes in a worker thread and
refuses more than --max-detokenize-tokens ids; generation routes hand the context length to the tokenizer, so
an over-long prompt is refused before all of it is tokenized, as a 400 naming the prompt's field."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Any

from fake_engine import FakeEngine
from fake_tokenizer import FakeTokenizer
from fastapi.testclient import TestClient
from server_helpers import MODEL, assert_error, chat_body, completion_body

from engine.errors import ContextLengthError
from server.app import create_app
from server.limits import RequestLimits


class _WatchingTokenizer(FakeTokenizer):
    """Records where decode runs and what limit encode is given; refuses text over the limit as the real
    tokenizer does."""

    def __init__(self) -> None:
        super().__init__()
        self.decoded_on_loop: list[bool] = []
        self.limits: list[int | None] = []

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        try:
            asyncio.get_running_loop()
            self.decoded_on_loop.append(True)
        except RuntimeError:
            self.decoded_on_loop.append(False)
        return super().decode(token_ids, skip_special_tokens)

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        limit = kwargs.get("limit")
        self.limits.append(limit)
        if limit is not None and len(text) > limit:
            raise ContextLengthError(limit, f"your prompt has more than {limit} tokens.")
        return super().encode(text, add_special_tokens)


def _client(engine: FakeEngine, **limits: int) -> TestClient:
    engine.tokenizer = _WatchingTokenizer()
    return TestClient(create_app(engine, limits=RequestLimits(**limits)))


def test_detokenize_runs_off_the_event_loop() -> None:
    engine = FakeEngine(model_name=MODEL)
    with _client(engine) as client:
        r = client.post("/detokenize", json={"model": MODEL, "tokens": [75, 76, 77]})
    assert r.status_code == 200, r.text
    assert r.json()["prompt"] == "HIJ"
    tokenizer = engine.tokenizer
    assert isinstance(tokenizer, _WatchingTokenizer) and tokenizer.decoded_on_loop == [False]


def test_detokenize_refuses_more_ids_than_its_limit_and_checks_the_vocabulary_still() -> None:
    engine = FakeEngine(model_name=MODEL)
    with _client(engine, max_detokenize_tokens=4) as client:
        assert client.post("/detokenize", json={"model": MODEL, "tokens": [75] * 4}).status_code == 200
        r = client.post("/detokenize", json={"model": MODEL, "tokens": [75] * 5})
        err = assert_error(r, 400, "tokens", "array_above_max_length")
        assert "at most 4" in err["message"]
        bad = client.post("/detokenize", json={"model": MODEL, "tokens": [10**6]})
        assert_error(bad, 400, "tokens")


def test_generation_routes_give_the_tokenizer_the_context_length() -> None:
    engine = FakeEngine(model_name=MODEL, max_model_len=64)
    with _client(engine) as client:
        assert client.post("/v1/completions", json=completion_body("hello", max_tokens=2)).status_code == 200
        assert client.post("/v1/chat/completions", json=chat_body("hi", max_tokens=2)).status_code == 200
        tokenizer = engine.tokenizer
        # Both prompts (other encodes, such as probing the template for tool-call markers, have no limit).
        assert isinstance(tokenizer, _WatchingTokenizer) and tokenizer.limits.count(64) == 2
        long = "x" * 1000
        r = client.post("/v1/completions", json=completion_body(long, max_tokens=2))
        err = assert_error(r, 400, "prompt", "context_length_exceeded")
        assert "more than 64 tokens" in err["message"]
        r = client.post("/v1/chat/completions", json=chat_body(long, max_tokens=2))
        assert_error(r, 400, "messages", "context_length_exceeded")
    assert len(engine.calls) == 2  # nothing over the limit reached the engine


def test_a_detokenize_body_far_past_its_token_limit_is_refused_before_it_is_parsed() -> None:
    engine = FakeEngine(model_name=MODEL)
    with _client(engine, max_detokenize_tokens=4) as client:
        r = client.post("/detokenize", json={"model": MODEL, "tokens": [75] * 2000})
        assert_error(r, 413, code="request_too_large")
        # Other routes keep the server's whole cap.
        ok = client.post("/tokenize", json={"model": MODEL, "prompt": "x" * 9000})
        assert ok.status_code == 200, ok.text
