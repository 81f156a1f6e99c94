"""POST /v1/chat/completions against the fake engine: request mapping, response shape, chat features."""

from __future__ import annotations

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import MODEL, assert_error, chat_body


def test_response_shape_and_usage(client: TestClient, engine: FakeEngine) -> None:
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=6, temperature=0))
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "chat.completion" and body["model"] == MODEL
    assert body["id"].startswith("chatcmpl-") and isinstance(body["created"], int)
    [choice] = body["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] == "length" and choice["logprobs"] is None
    message = choice["message"]
    assert message == {"role": "assistant", "content": message["content"], "refusal": None}
    assert len(message["content"]) == 6  # the fake spells one character per token
    call = engine.calls[-1]
    assert body["usage"] == {
        "prompt_tokens": len(call.prompt_token_ids),
        "completion_tokens": 6,
        "total_tokens": len(call.prompt_token_ids) + 6,
        "prompt_tokens_details": {"cached_tokens": 0},
    }


def test_sampling_params_reach_the_engine(client: TestClient, engine: FakeEngine) -> None:
    body = chat_body(
        max_completion_tokens=5,
        max_tokens=99,  # max_completion_tokens wins
        temperature=0.5,
        top_p=0.9,
        top_k=7,
        min_p=0.1,
        seed=42,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.2,
        stop=["zz", ""],
        stop_token_ids=[5],
        ignore_eos=True,
        min_tokens=2,
        unknown_field={"is": "ignored"},
    )
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    p = engine.calls[-1].params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_p, p.seed) == (5, 0.5, 0.9, 7, 0.1, 42)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty) == (0.5, -0.5, 1.2)
    assert p.stop == ["zz"] and p.stop_token_ids == [5] and p.ignore_eos and p.min_tokens == 2
    assert p.logprobs is None and p.prompt_logprobs is None


def test_defaults_fill_the_context(client: TestClient, engine: FakeEngine) -> None:
    body = chat_body()
    del body["max_tokens"]
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    call = engine.calls[-1]
    assert call.params.max_tokens == engine.max_model_len - len(call.prompt_token_ids)
    assert call.params.temperature == 1.0 and call.params.n == 1


def test_top_p_zero_means_greedy(client: TestClient, engine: FakeEngine) -> None:
    assert client.post("/v1/chat/completions", json=chat_body(top_p=0, temperature=1.5)).status_code == 200
    assert engine.calls[-1].params.greedy


def test_messages_go_through_the_template(client: TestClient, engine: FakeEngine) -> None:
    messages = [
        {"role": "developer", "content": "be brief"},
        {"role": "system", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
        {"role": "user", "content": "q", "name": "bob"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "1", "type": "function"}]},
        {"role": "tool", "content": "result", "tool_call_id": "1"},
    ]
    body = {"model": MODEL, "messages": messages, "max_tokens": 2, "chat_template_kwargs": {"flavour": 1}}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    call = engine.tokenizer.template_calls[-1]
    assert [m["role"] for m in call["messages"]] == ["developer", "system", "user", "assistant", "tool"]
    assert call["messages"][1]["content"] == "a\nb" and call["messages"][3]["content"] == ""
    assert call["messages"][2]["name"] == "bob" and call["messages"][4]["tool_call_id"] == "1"
    assert call["flavour"] == 1 and call["add_generation_prompt"] is True
    prompt = engine.tokenizer.decode(engine.calls[-1].prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("<|im_start|>assistant\n")


def test_continue_final_message(client: TestClient, engine: FakeEngine) -> None:
    msgs = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "The answer is"}]
    body = {"model": MODEL, "messages": msgs, "max_tokens": 2}
    body |= {"add_generation_prompt": False, "continue_final_message": True}
    assert client.post("/v1/chat/completions", json=body).status_code == 200
    prompt = engine.tokenizer.decode(engine.calls[-1].prompt_token_ids, skip_special_tokens=False)
    assert prompt.endswith("The answer is")
    body["add_generation_prompt"] = True
    assert_error(client.post("/v1/chat/completions", json=body), 400, "continue_final_message")


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        # tool_choice defaults to "auto" with tools, which needs a tool-call format the template lacks.
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tool_choice"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "auto"}, "tool_choice"),
        ({"tools": [{"type": "retrieval"}], "tool_choice": "required"}, "tools"),
        ({"functions": [{"name": "f"}]}, "functions"),
        ({"response_format": {"type": "json_schema"}}, "response_format"),
        ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex"),
        ({"logit_bias": {"5": 10}}, "logit_bias"),
        ({"top_logprobs": 3}, "top_logprobs"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
            "messages",
        ),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "robot", "content": "x"}]}, "messages"),
        ({"temperature": 2.5}, "temperature"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_completion_tokens": -1}, "max_completion_tokens"),
        ({"top_logprobs": 21, "logprobs": True}, "top_logprobs"),
        ({"stop_token_ids": [10**6]}, "stop_token_ids"),
        ({"min_tokens": 9}, "min_tokens"),
        ({"seed": 2**64}, "seed"),
        ({"chat_template_kwargs": {"fail": True}}, "messages"),
    ],
)
def test_rejected_with_param(client: TestClient, engine: FakeEngine, extra: dict, param: str) -> None:
    assert_error(client.post("/v1/chat/completions", json=chat_body(**extra)), 400, param)
    assert engine.calls == []


def test_tools_with_tool_choice_none_are_ignored(client: TestClient) -> None:
    tools = [{"type": "function", "function": {"name": "f"}}]
    body = chat_body(tools=tools, tool_choice="none", response_format={"type": "text"})
    assert client.post("/v1/chat/completions", json=body).status_code == 200


def test_n_and_logprobs(client: TestClient) -> None:
    body = chat_body(n=2, max_tokens=4, temperature=0, logprobs=True, top_logprobs=2)
    choices = client.post("/v1/chat/completions", json=body).json()["choices"]
    assert [c["index"] for c in choices] == [0, 1]
    assert choices[0]["message"]["content"] == choices[1]["message"]["content"]  # greedy: identical
    content = choices[0]["logprobs"]["content"]
    assert choices[0]["logprobs"]["refusal"] is None
    assert "".join(t["token"] for t in content) == choices[0]["message"]["content"]
    for t in content:
        assert t["bytes"] == list(t["token"].encode()) and len(t["top_logprobs"]) == 2
        assert t["top_logprobs"][0]["token"] == t["token"] and t["logprob"] <= 0


# The engine applies stop strings and EOS (tests/engine: test_detokenizer, test_engine_limits, test_scheduler);
# the server's part is to hand them over intact and to report what the engine did.


def test_stop_strings_reach_the_engine_and_its_stop_is_reported(
    client: TestClient, engine: FakeEngine
) -> None:
    for stop, expected in (("ab", ["ab"]), (["x y", "", "z"], ["x y", "z"]), (None, [])):
        body = chat_body(max_tokens=30, temperature=0, stop=stop, include_stop_str_in_output=stop == "ab")
        r = client.post("/v1/chat/completions", json=body).json()
        params = engine.calls[-1].params
        assert params.stop == expected  # a lone string becomes a list; "" would match everywhere: dropped
        assert params.include_stop_str_in_output == (stop == "ab")
        assert not params.ignore_eos and params.stop_token_ids == []
    text = client.post("/v1/chat/completions", json=chat_body(max_tokens=30, temperature=0)).json()
    full = text["choices"][0]["message"]["content"]
    stop = full[5:7]
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=30, temperature=0, stop=stop)).json()
    # The fake cuts at the stop string; the server must pass that text and reason on unchanged.
    assert r["choices"][0]["finish_reason"] == "stop"
    assert r["choices"][0]["message"]["content"] == full[: full.index(stop)]


def test_eos_flags_reach_the_engine_and_an_eos_stop_is_reported(
    engine: FakeEngine, client: TestClient
) -> None:
    client.post("/v1/chat/completions", json=chat_body(max_tokens=10, ignore_eos=True, stop_token_ids=[70]))
    assert engine.calls[-1].params.ignore_eos and engine.calls[-1].params.stop_token_ids == [70]
    engine.eos_after = 3
    r = client.post("/v1/chat/completions", json=chat_body(max_tokens=10)).json()
    assert not engine.calls[-1].params.ignore_eos
    # EOS ends the sequence without a stop_reason: reported as "stop", the EOS token counted, not shown.
    assert r["choices"][0]["finish_reason"] == "stop" and r["usage"]["completion_tokens"] == 3
    assert len(r["choices"][0]["message"]["content"]) == 2


def test_prefix_cache_hits_are_reported(client: TestClient) -> None:
    long = "the same long prefix " * 4
    first = client.post("/v1/chat/completions", json=chat_body(long + "one")).json()["usage"]
    second = client.post("/v1/chat/completions", json=chat_body(long + "two")).json()["usage"]
    assert first["prompt_tokens_details"]["cached_tokens"] == 0
    assert second["prompt_tokens_details"]["cached_tokens"] >= len(long) - 4


def test_request_cannot_replace_the_chat_template(client: TestClient, engine: FakeEngine) -> None:
    # The template comes from the model: a request-supplied one would also let any client run an arbitrary
    # (slow, memory-hungry) Jinja program on the event loop.
    kwargs = {"chat_template_kwargs": {"chat_template": "{{ messages[0]['content'] }}"}}
    assert_error(client.post("/v1/chat/completions", json=chat_body(**kwargs)), 400, "chat_template_kwargs")
    tokenize = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], **kwargs}
    assert_error(client.post("/tokenize", json=tokenize), 400, "chat_template_kwargs")
    assert engine.calls == [] and engine.tokenizer.template_calls == []
    # A top-level chat_template is refused the same way, with a message that says where the template comes from.
    for path, body in (
        ("/v1/chat/completions", chat_body(chat_template="x")),
        ("/tokenize", {**tokenize, "chat_template": "x"}),
    ):
        err = assert_error(client.post(path, json=body), 400, "chat_template")
        assert (
            err["message"] == "chat_template is not supported: the chat template always comes from the model."
        )


def test_a_structured_output_request_hands_its_constraint_to_the_engine(
    client: TestClient, engine: FakeEngine
) -> None:
    client.post("/v1/chat/completions", json=chat_body(max_tokens=5))
    assert engine.calls[-1].params.structured is None
    client.post("/v1/chat/completions", json=chat_body(max_tokens=5, response_format={"type": "json_object"}))
    assert engine.calls[-1].params.structured is not None and engine.calls[-1].params.structured.kind
