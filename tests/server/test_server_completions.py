"""POST /v1/completions against the fake engine: prompt shapes, echo, logprobs, choice numbering."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import MODEL, assert_error, completion_body


def test_string_prompt(client: TestClient, engine: FakeEngine) -> None:
    r = client.post("/v1/completions", json=completion_body("hello", max_tokens=5, temperature=0))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL and body["id"].startswith("cmpl-")
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["logprobs"] is None and choice["finish_reason"] == "length"
    assert len(choice["text"]) == 5
    assert engine.calls[-1].prompt_token_ids == engine.tokenizer.encode("hello")
    assert body["usage"]["prompt_tokens"] == 5 and body["usage"]["completion_tokens"] == 5
    assert body["usage"]["prompt_tokens_details"] == {"cached_tokens": 0}


def test_default_max_tokens_is_16(client: TestClient, engine: FakeEngine) -> None:
    body = completion_body()
    del body["max_tokens"]
    assert client.post("/v1/completions", json=body).status_code == 200
    assert engine.calls[-1].params.max_tokens == 16


@pytest.mark.parametrize(
    "prompt",
    [["ab", "cd", "ef"], [[10, 11], [12, 13, 14], [15]]],
)
def test_several_prompts_number_choices_by_prompt_then_n(
    client: TestClient, engine: FakeEngine, prompt
) -> None:
    body = completion_body(prompt, n=2, max_tokens=3, temperature=0)
    r = client.post("/v1/completions", json=body).json()
    assert [c["index"] for c in r["choices"]] == list(range(6))
    # Choices 2k and 2k+1 share prompt k; greedy makes their texts equal, and different prompts differ.
    texts = [c["text"] for c in r["choices"]]
    assert texts[0] == texts[1] and texts[2] == texts[3] and texts[4] == texts[5]
    assert len(engine.calls) == 3
    assert r["usage"]["prompt_tokens"] == sum(len(c.prompt_token_ids) for c in engine.calls)
    assert r["usage"]["completion_tokens"] == 6 * 3


def test_token_prompt_and_echo(client: TestClient, engine: FakeEngine) -> None:
    ids = engine.tokenizer.encode("abc")
    r = client.post("/v1/completions", json=completion_body(ids, echo=True, max_tokens=2)).json()
    assert engine.calls[-1].prompt_token_ids == ids
    assert r["choices"][0]["text"].startswith("abc") and len(r["choices"][0]["text"]) == 5


def test_echo_with_logprobs_covers_prompt_and_output(client: TestClient, engine: FakeEngine) -> None:
    body = completion_body("abcd", echo=True, logprobs=2, max_tokens=3, temperature=0)
    r = client.post("/v1/completions", json=body).json()
    assert engine.calls[-1].params.prompt_logprobs == 2 and engine.calls[-1].params.logprobs == 2
    choice = r["choices"][0]
    lp = choice["logprobs"]
    assert "".join(lp["tokens"]) == choice["text"] and len(lp["tokens"]) == 4 + 3
    assert lp["text_offset"] == list(range(7))
    # The first prompt token has nothing before it: reported as given (0.0), never null.
    assert lp["token_logprobs"][0] == 0.0 and lp["top_logprobs"][0] == {"a": 0.0}
    assert all(isinstance(x, float) and x < 0 for x in lp["token_logprobs"][1:])
    for token, top in zip(lp["tokens"], lp["top_logprobs"], strict=True):
        assert token in top and len(top) <= 2


def test_logprobs_without_echo(client: TestClient) -> None:
    r = client.post("/v1/completions", json=completion_body("xy", logprobs=0, max_tokens=4)).json()
    lp = r["choices"][0]["logprobs"]
    assert len(lp["tokens"]) == 4 and lp["text_offset"] == [0, 1, 2, 3]
    assert all(len(top) == 1 for top in lp["top_logprobs"])  # k=0: just the sampled token


@pytest.mark.parametrize(
    ("prompt", "extra", "param"),
    [
        ("", {}, "prompt"),
        ([], {}, "prompt"),
        ([[]], {}, "prompt"),
        ([-1, 5], {}, "prompt"),
        ([10**7], {}, "prompt"),
        (None, {}, "prompt"),
        ({"a": 1}, {}, "prompt"),
        ("x", {"suffix": "tail"}, "suffix"),
        ("x", {"logprobs": 21}, "logprobs"),
        ("x", {"max_tokens": 0}, "max_tokens"),
        ("x", {"top_p": 1.5}, "top_p"),
        ("x", {"presence_penalty": 3}, "presence_penalty"),
        ("x", {"stop": 5}, "stop"),
    ],
)
def test_rejected_with_param(client: TestClient, engine: FakeEngine, prompt, extra: dict, param: str) -> None:
    assert_error(client.post("/v1/completions", json=completion_body(prompt, **extra)), 400, param)
    assert engine.calls == []


def test_missing_prompt(client: TestClient) -> None:
    assert_error(client.post("/v1/completions", json={"model": MODEL}), 400, "prompt")


def test_context_length(client: TestClient, engine: FakeEngine) -> None:
    err = assert_error(
        client.post("/v1/completions", json=completion_body("x" * 250, max_tokens=7)),
        400,
        "prompt",
        "context_length_exceeded",
    )
    assert "maximum context length" in err["message"]
    # max_tokens null means the default 16, which a prompt filling the context leaves no room for.
    body = completion_body("x" * 256, max_tokens=None)
    assert_error(client.post("/v1/completions", json=body), 400, code="context_length_exceeded")
    assert engine.calls == []
    assert client.post("/v1/completions", json=completion_body("x" * 250, max_tokens=6)).status_code == 200


def test_engine_value_error_is_a_400(client: TestClient, engine: FakeEngine) -> None:
    engine.num_blocks = 1  # the fake refuses prompts that can never fit the KV cache
    err = assert_error(client.post("/v1/completions", json=completion_body("hello there")), 400)
    assert "KV cache" in err["message"]
