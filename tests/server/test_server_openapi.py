"""The published schema: `/openapi.json` is valid OpenAPI 3.1, documents `cache_salt` with its limits, and
agrees on type with OpenAI's own spec for every request field both define. Also the request rules that now
live in the typed models: a top-level `chat_template` is refused, unknown fields are ignored and logged."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import pytest
import yaml
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from openapi_spec_validator import OpenAPIV31SpecValidator
from server_helpers import assert_error, chat_body, completion_body

from server.app import create_app
from server.protocol import UNKNOWN_FIELDS, _UnknownFieldLog

OPENAI_SPEC = Path(__file__).resolve().parent / "openai-openapi-subset.yaml"
# Our request model -> OpenAI's request schema, by the route both serve.
PAIRS = {
    "/v1/chat/completions": "CreateChatCompletionRequest",
    "/v1/completions": "CreateCompletionRequest",
}


@pytest.fixture(scope="module")
def published() -> dict[str, Any]:
    with TestClient(create_app(FakeEngine())) as c:
        r = c.get("/openapi.json")
    assert r.status_code == 200
    return r.json()


def deref(node: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    while isinstance(node, dict) and "$ref" in node:
        target: Any = spec
        for part in node["$ref"].removeprefix("#/").split("/"):
            target = target[part]
        node = target
    return node


def json_types(node: dict[str, Any], spec: dict[str, Any]) -> set[str]:
    """The JSON types a schema admits (null left out: nullability is a separate question)."""
    node = deref(node, spec)
    types: set[str] = set()
    if "type" in node:
        kind = node["type"]
        types |= set(kind) if isinstance(kind, list) else {kind}
    elif "enum" in node:
        names = {str: "string", bool: "boolean", int: "integer", float: "number"}
        types |= {names[type(v)] for v in node["enum"] if v is not None}
    for key in ("anyOf", "oneOf", "allOf"):
        for sub in node.get(key, ()):
            types |= json_types(sub, spec)
    return types - {"null"}


def properties(node: dict[str, Any], spec: dict[str, Any]) -> dict[str, Any]:
    node = deref(node, spec)
    props = dict(node.get("properties", {}))
    for sub in node.get("allOf", ()):
        props.update(properties(sub, spec))
    return props


def request_schema(published: dict[str, Any], path: str) -> dict[str, Any]:
    body = published["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
    return deref(body, published)


def test_schema_is_valid_openapi_3_1(published: dict[str, Any]) -> None:
    assert published["openapi"].startswith("3.1")
    OpenAPIV31SpecValidator(published).validate()


@pytest.mark.parametrize("path", sorted(PAIRS))
def test_generation_requests_document_cache_salt(published: dict[str, Any], path: str) -> None:
    schema = request_schema(published, path)
    salt = schema["properties"]["cache_salt"]
    assert json_types(salt, published) == {"string"}
    assert salt["minLength"] == 1 and salt["maxLength"] == 1024
    assert "isolat" in salt["description"].lower()
    assert "cache_salt" not in schema.get("required", [])
    # The errors the route really answers with, in OpenAI's shape; not FastAPI's 422.
    responses = published["paths"][path]["post"]["responses"]
    assert "422" not in responses and {"400", "401", "413"} <= set(responses)
    error = deref(responses["400"]["content"]["application/json"]["schema"], published)
    assert set(properties(error["properties"]["error"], published)) == {"message", "type", "param", "code"}


def test_tokenize_and_detokenize_publish_their_bodies(published: dict[str, Any]) -> None:
    for path, field in (("/tokenize", "prompt"), ("/detokenize", "tokens")):
        assert field in request_schema(published, path)["properties"]


@pytest.mark.parametrize("path", sorted(PAIRS))
def test_shared_fields_agree_with_openai_on_type(published: dict[str, Any], path: str) -> None:
    openai_spec = yaml.safe_load(OPENAI_SPEC.read_text())
    ours = properties(request_schema(published, path), published)
    theirs = properties(openai_spec["components"]["schemas"][PAIRS[path]], openai_spec)
    shared = sorted(set(ours) & set(theirs))
    assert len(shared) >= 15, shared  # the comparison really covers the OpenAI fields we serve
    disagree = {
        name: (json_types(ours[name], published), json_types(theirs[name], openai_spec))
        for name in shared
        if json_types(ours[name], published) != json_types(theirs[name], openai_spec)
    }
    assert disagree == {}


def test_docs_page_is_served(client: TestClient) -> None:
    r = client.get("/docs")
    assert r.status_code == 200 and "/openapi.json" in r.text


@pytest.mark.parametrize(
    ("path", "body"),
    [
        ("/v1/chat/completions", chat_body(chat_template="{{ messages }}")),
        ("/tokenize", {"messages": [{"role": "user", "content": "x"}], "chat_template": "{{ messages }}"}),
    ],
)
def test_top_level_chat_template_is_refused(
    client: TestClient, engine: FakeEngine, path: str, body: dict
) -> None:
    err = assert_error(client.post(path, json=body), 400, "chat_template")
    assert "{{" not in err["message"]
    assert engine.calls == []
    # null means absent, as for every other optional field.
    assert client.post(path, json=body | {"chat_template": None}).status_code == 200


def test_bad_salt_wins_over_chat_template(client: TestClient) -> None:
    r = client.post("/v1/chat/completions", json=chat_body(chat_template="x", cache_salt=""))
    assert_error(r, 400, "cache_salt", "invalid_cache_salt")


def test_unknown_fields_are_ignored_and_logged_once_per_name(
    client: TestClient, engine: FakeEngine, caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(UNKNOWN_FIELDS, "_seen", set())  # other tests may have sent these names already
    caplog.set_level(logging.DEBUG, logger="brine.server")

    def unknown_lines() -> list[tuple[int, str]]:
        lines = [(r.levelno, r.getMessage()) for r in caplog.records if "unknown field" in r.getMessage()]
        caplog.clear()
        return sorted(lines, key=lambda line: line[1])

    body = completion_body(guided_decoding_backend="x", priority=3)
    assert client.post("/v1/completions", json=body).status_code == 200
    assert engine.calls[-1].prompt_token_ids == engine.tokenizer.encode("hello")
    first = unknown_lines()
    assert first == [
        (logging.WARNING, "ignoring unknown field 'guided_decoding_backend' in CompletionRequest"),
        (logging.WARNING, "ignoring unknown field 'priority' in CompletionRequest"),
    ]
    assert client.post("/v1/completions", json=body | {"new_one": 1}).status_code == 200
    assert unknown_lines() == [
        (logging.DEBUG, "ignoring unknown field 'guided_decoding_backend' in CompletionRequest"),
        (logging.WARNING, "ignoring unknown field 'new_one' in CompletionRequest"),
        (logging.DEBUG, "ignoring unknown field 'priority' in CompletionRequest"),
    ]
    # Known fields, the salt among them, are never reported.
    assert client.post("/v1/completions", json=completion_body(cache_salt="t", top_k=2)).status_code == 200
    assert unknown_lines() == []


def test_the_unknown_field_log_shortens_long_names_and_is_bounded(caplog: pytest.LogCaptureFixture) -> None:
    log = _UnknownFieldLog()  # a fresh one: the shared log's state depends on the tests before
    log.MAX_NAMES = 2
    caplog.set_level(logging.DEBUG, logger="brine.server")
    log.log("M", {"a" * 64, "b" * 65, "c"})
    log.log("M", {"a" * 64})
    assert [(r.levelno, r.getMessage()) for r in caplog.records] == [
        (logging.WARNING, f"ignoring unknown field '{'a' * 64}' in M"),  # 64 characters: shown whole
        (logging.WARNING, f"ignoring unknown field '{'b' * 64}...' in M"),  # longer: cut at 64
        (logging.DEBUG, "ignoring unknown field 'c' in M"),  # past the bound: debug, not remembered
        (logging.DEBUG, f"ignoring unknown field '{'a' * 64}' in M"),  # seen before
    ]
