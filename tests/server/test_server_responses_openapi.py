"""`/openapi.json` documents the Responses routes: the request with its cache fields (`cache_salt`,
`prompt_cache_key`), the response object with usage's cache fields, GET and DELETE by id; and the request's
fields agree on type with OpenAI's own `CreateResponse` where both define them."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from openapi_spec_validator import OpenAPIV31SpecValidator
from test_server_openapi import deref, json_types, properties

from server.app import create_app

FULL_SPEC = Path(__file__).resolve().parents[3] / "shared" / "openai-openapi.yaml"  # beside the checkout


@pytest.fixture(scope="module")
def published() -> dict[str, Any]:
    with TestClient(create_app(FakeEngine())) as c:
        return c.get("/openapi.json").json()


def test_the_routes_and_their_cache_fields_are_documented(published: dict[str, Any]) -> None:
    OpenAPIV31SpecValidator(published).validate()
    post = published["paths"]["/v1/responses"]["post"]
    assert post["operationId"] == "createResponse" and "422" not in post["responses"]
    request = properties(post["requestBody"]["content"]["application/json"]["schema"], published)
    assert (
        request["cache_salt"]["maxLength"] == 1024
        and "isolat" in request["cache_salt"]["description"].lower()
    )
    key = deref(request["prompt_cache_key"], published)
    assert "never an isolation key" in str(key)
    assert {"input", "instructions", "max_output_tokens", "tools", "tool_choice", "text", "store"} <= set(
        request
    )
    assert "previous_response_id" in request
    body = post["responses"]["200"]["content"]
    assert "text/event-stream" in body
    response = properties(body["application/json"]["schema"], published)
    assert {"usage", "prompt_cache_key", "output", "status"} <= set(response)
    usage = properties(next(s for s in response["usage"]["anyOf"] if "$ref" in s), published)
    details = properties(usage["input_tokens_details"], published)
    assert {"cached_tokens", "cache_write_tokens"} <= set(details)
    assert {"400", "401", "404", "413", "503"} <= set(post["responses"])
    by_id = published["paths"]["/v1/responses/{response_id}"]
    assert set(by_id) == {"get", "delete"} and "404" in by_id["get"]["responses"]
    assert any(p["name"] == "cache_salt" and p["in"] == "query" for p in by_id["get"]["parameters"])


def test_request_fields_agree_with_openai_on_type(published: dict[str, Any]) -> None:
    if not FULL_SPEC.exists():
        pytest.skip("OpenAI's full spec is not beside this checkout")
    theirs_spec = yaml.safe_load(FULL_SPEC.read_text())
    post = published["paths"]["/v1/responses"]["post"]
    ours = properties(post["requestBody"]["content"]["application/json"]["schema"], published)
    theirs = properties(theirs_spec["components"]["schemas"]["CreateResponse"], theirs_spec)
    shared = sorted(set(ours) & set(theirs))
    assert len(shared) >= 15, shared
    disagree = {
        name: (json_types(ours[name], published), json_types(theirs[name], theirs_spec))
        for name in shared
        if not json_types(ours[name], published) <= json_types(theirs[name], theirs_spec)
    }
    assert disagree == {}
