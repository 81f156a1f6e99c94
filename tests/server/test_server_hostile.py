"""What one request may ask for, and the hostile inputs a security probe found (issue 17): per-request limits
(each a 400 naming the parameter, before any tokenizing), lone surrogates and untokenizable text (a 400 and
one log line, no traceback), errors that do not echo map keys or exception text, HEAD /health, WebSockets
refused by the auth layer, and access logs without query strings."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from jinja2 import TemplateError
from server_helpers import MODEL, assert_error, chat_body, completion_body
from starlette.websockets import WebSocket, WebSocketDisconnect

from server import cli, serve
from server.app import create_app
from server.limits import RequestLimits
from server.serve import DropQueryString

SMALL = RequestLimits(
    max_stop_strings=2,
    max_stop_string_chars=5,
    max_stop_token_ids=3,
    max_logit_bias=2,
    max_prompts=3,
    max_seqs_per_request=4,
)


@pytest.fixture
def small(engine: FakeEngine) -> Iterator[TestClient]:
    with TestClient(create_app(engine, limits=SMALL)) as c:
        yield c


# (extra fields at the limit, the same just over it, the parameter named)
LIMIT_CASES = [
    ({"stop": ["a", "b"]}, {"stop": ["a", "b", "c"]}, "stop", "array_above_max_length"),
    ({"stop": "abcde"}, {"stop": "abcdef"}, "stop", "string_above_max_length"),
    ({"stop": ["x", "abcde"]}, {"stop": ["x", "abcdef"]}, "stop", "string_above_max_length"),
    ({"stop_token_ids": [1, 2, 3]}, {"stop_token_ids": [1, 2, 3, 4]}, "stop_token_ids", None),
    ({"prompt": ["a", "b", "c"]}, {"prompt": ["a", "b", "c", "d"]}, "prompt", None),
    ({"prompt": [[5], [6], [7]]}, {"prompt": [[5], [6], [7], [8]]}, "prompt", None),
    ({"prompt": ["a", "b"], "n": 2}, {"prompt": ["a", "b"], "n": 3}, "n", None),
    ({"n": 4}, {"n": 5}, "n", None),
]


@pytest.mark.parametrize("at, over, param, code", LIMIT_CASES)
def test_each_limit_is_a_400_naming_the_parameter(
    small: TestClient, engine: FakeEngine, at: dict, over: dict, param: str, code: str | None
) -> None:
    assert small.post("/v1/completions", json=completion_body(**at)).status_code == 200
    calls = len(engine.calls)
    err = assert_error(small.post("/v1/completions", json=completion_body(**over)), 400, param)
    assert err["code"] == (code or "array_above_max_length")
    assert len(engine.calls) == calls  # refused before anything reached the engine


def test_logit_bias_entries_are_limited_before_anything_else_reads_them(small: TestClient) -> None:
    # logit_bias itself is not supported (a 400 either way); the limit bounds what the server reads first.
    err = assert_error(
        small.post("/v1/chat/completions", json=chat_body(logit_bias={"1": 1, "2": 1, "3": 1})), 400
    )
    assert err["param"] == "logit_bias" and err["code"] == "array_above_max_length"


def test_chat_limits_use_the_same_rules(small: TestClient) -> None:
    assert_error(small.post("/v1/chat/completions", json=chat_body(stop=["a", "b", "c"])), 400, "stop")
    assert_error(small.post("/v1/chat/completions", json=chat_body(n=5)), 400, "n")


def test_the_default_limits_are_openais_four_stop_strings_and_bounded_elsewhere(client: TestClient) -> None:
    assert_error(client.post("/v1/completions", json=completion_body(stop=list("abcde"))), 400, "stop")
    assert client.post("/v1/completions", json=completion_body(stop=list("abcd"))).status_code == 200
    fan_out = completion_body(prompt=[[1, 2]] * 100, n=128, max_tokens=1)  # the probe's 12,800 sequences
    assert_error(client.post("/v1/completions", json=fan_out), 400, "n")
    many = completion_body(prompt=[[1, 2]] * 100_000, max_tokens=1)
    assert_error(client.post("/v1/completions", json=many), 400, "prompt")
    ids = completion_body(stop_token_ids=list(range(100_000)))
    assert_error(client.post("/v1/completions", json=ids), 400, "stop_token_ids")


def test_too_many_prompts_are_refused_before_tokenizing(
    small: TestClient, engine: FakeEngine, monkeypatch
) -> None:
    def encode(*_a, **_k):
        raise AssertionError("tokenized a request that was over a limit")

    monkeypatch.setattr(engine.tokenizer, "encode", encode)
    assert_error(small.post("/v1/completions", json=completion_body(prompt=["a"] * 10)), 400, "prompt")


def test_cli_flags_feed_the_limits_and_default_to_request_limits() -> None:
    args = cli.build_parser().parse_args(["serve"])
    assert serve.request_limits(args) == RequestLimits()
    args = cli.build_parser().parse_args(
        ["serve", "--max-stop-strings", "2", "--max-stop-string-chars", "5", "--max-stop-token-ids", "3",
         "--max-logit-bias", "2", "--max-prompts-per-request", "3", "--max-seqs-per-request", "4"]
    )  # fmt: skip
    assert serve.request_limits(args) == SMALL


# ---- lone surrogates and untokenizable text -----------------------------------------------------------------

SURROGATE_CASES = [
    ("/v1/completions", completion_body(prompt="hi \ud800 there"), "prompt"),
    ("/v1/completions", completion_body(prompt=["ok", "\udfff"]), "prompt"),
    ("/v1/chat/completions", chat_body(content="\ud800"), "messages"),
    ("/v1/chat/completions", {**chat_body(), "model": "x\ud800"}, "model"),
    ("/v1/completions", completion_body(stop=["\ud800"]), "stop"),
    ("/v1/completions", completion_body(cache_salt="salt\ud800"), "cache_salt"),
    ("/tokenize", {"model": MODEL, "prompt": "\ud800"}, "prompt"),
    ("/tokenize", {"model": "\udc00"}, "model"),
]


@pytest.mark.parametrize("path, body, param", SURROGATE_CASES)
def test_a_lone_surrogate_is_a_400_naming_the_field_with_one_log_line(
    client: TestClient, caplog: pytest.LogCaptureFixture, path: str, body: dict, param: str | None
) -> None:
    caplog.set_level(logging.INFO)
    # json.dumps writes the lone surrogate as the "\ud800" escape the probe sent.
    r = client.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    err = assert_error(r, 400)
    assert err["param"] == param
    assert err["code"] == ("invalid_cache_salt" if param == "cache_salt" else "invalid_text")
    assert not [rec for rec in caplog.records if rec.exc_info], "a traceback was logged"
    # One line (none where the schema already refuses the field, as it does a salt it cannot accept).
    assert len([rec for rec in caplog.records if "surrogate" in rec.getMessage()]) == (param != "cache_salt")


def test_text_the_tokenizer_refuses_is_a_400_naming_the_field(
    client: TestClient, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def encode(text: str, add_special_tokens: bool = True, **_reuse: object) -> list[int]:
        raise RuntimeError("the tokenizer broke on " + text)

    monkeypatch.setattr(engine.tokenizer, "encode", encode)
    caplog.set_level(logging.INFO)
    err = assert_error(
        client.post("/v1/completions", json=completion_body(prompt="secret words")), 400, "prompt"
    )
    assert "secret" not in err["message"]
    assert_error(client.post("/v1/chat/completions", json=chat_body()), 400, "messages")
    assert_error(client.post("/tokenize", json={"prompt": "x"}), 400, "prompt")
    assert not [rec for rec in caplog.records if rec.exc_info]


# ---- errors do not echo input ---------------------------------------------------------------------------------


def test_logit_bias_keys_are_not_echoed(client: TestClient) -> None:
    r = client.post("/v1/completions", json=completion_body(logit_bias={"SECRET-KEY-TEXT": "not a number"}))
    err = assert_error(r, 400, "logit_bias")
    assert "SECRET" not in r.text and err["message"].startswith("logit_bias:")


def test_a_chat_template_exception_is_not_echoed_but_its_own_words_are(
    client: TestClient, engine: FakeEngine, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*_a, **_k):
        raise TypeError("can only concatenate: SECRET-USER-TEXT")

    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", broken)
    r = client.post("/v1/chat/completions", json=chat_body())
    assert_error(r, 400, "messages")
    assert "SECRET" not in r.text

    def refuses(*_a, **_k):
        try:
            raise TemplateError("Conversation roles must alternate user/assistant")
        except TemplateError as exc:
            raise ValueError(f"Could not apply the chat template: {exc}") from exc  # as engine.tokenizer does

    monkeypatch.setattr(engine.tokenizer, "apply_chat_template", refuses)
    err = assert_error(client.post("/v1/chat/completions", json=chat_body()), 400, "messages")
    assert "Conversation roles must alternate" in err["message"]


def test_an_unknown_model_is_named_as_openai_names_it(client: TestClient) -> None:
    err = assert_error(
        client.post("/v1/completions", json={**completion_body(), "model": "gpt-x"}), 404, "model"
    )
    assert "gpt-x" in err["message"]


# ---- HEAD /health, WebSockets, access log -------------------------------------------------------------------


@pytest.mark.parametrize("keys", [(), ("k",)])
def test_head_health_answers_like_get(engine: FakeEngine, keys: tuple[str, ...]) -> None:
    with TestClient(create_app(engine, api_keys=keys)) as c:
        head, get = c.head("/health"), c.get("/health")
        assert head.status_code == get.status_code == 200 and head.content == b""
        engine.healthy = False
        assert c.head("/health").status_code == c.get("/health").status_code == 503


@pytest.mark.parametrize("keys", [(), ("k",)])
def test_websockets_are_refused_by_the_auth_layer(engine: FakeEngine, keys: tuple[str, ...]) -> None:
    app = create_app(engine, api_keys=keys)

    async def echo(ws: WebSocket) -> None:  # a route a later change might add
        await ws.accept()
        await ws.send_text("in")
        await ws.close()

    app.add_api_websocket_route("/ws", echo)
    with TestClient(app) as c:
        with pytest.raises(WebSocketDisconnect) as info:
            with c.websocket_connect("/ws", headers={"Authorization": "Bearer k"}) as ws:
                ws.receive_text()
        assert info.value.code == 1008
        assert c.get("/health").status_code == 200  # HTTP still passes


def test_the_access_log_drops_query_strings() -> None:
    record = logging.LogRecord(
        "uvicorn.access", logging.INFO, "", 0, '%s - "%s %s HTTP/%s" %d',
        ("127.0.0.1:5", "GET", "/v1/models?api_key=sk-secret", "1.1", 200), None,
    )  # fmt: skip
    assert DropQueryString().filter(record)
    assert record.getMessage() == '127.0.0.1:5 - "GET /v1/models HTTP/1.1" 200'


def test_every_prompt_of_one_request_has_the_same_owner_for_fair_scheduling(
    client: TestClient, engine: FakeEngine
) -> None:
    assert (
        client.post("/v1/completions", json=completion_body(prompt=["a", "b", "c"], n=2)).status_code == 200
    )
    assert client.post("/v1/completions", json=completion_body(prompt="d")).status_code == 200
    owners = [call.owner for call in engine.calls]
    assert len(set(owners[:3])) == 1 and owners[3] not in owners[:3] and None not in owners


def test_the_serve_flags_page_documents_every_limit_flag_with_its_default() -> None:
    readme = (Path(__file__).resolve().parents[2] / "docs" / "serve-flags.md").read_text()
    parser = cli.build_parser()
    serve = parser._subparsers._group_actions[0].choices["serve"]  # type: ignore[union-attr]
    for action in serve._actions:
        if action.dest.startswith("max_") and action.dest not in ("max_num_seqs", "max_num_batched_tokens",
                                                                   "max_model_len"):  # fmt: skip
            flag = action.option_strings[0]
            assert f"[{flag} {action.default}]" in readme, flag
            assert f"`{flag}`" in readme, flag
