"""The Messages routes in `/openapi.json` (request bodies with `cache_control` and `cache_salt`, the response's
cache fields), and schemathesis over them from that published schema: generated bodies, valid or not, never
get a 5xx, and every 200 matches the documented response."""

from __future__ import annotations

from typing import Any

import hypothesis_compat
import pytest
import schemathesis
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance
from server_helpers import MODEL

from server.app import create_app

schemathesis.experimental.OPEN_API_3_1.enable()
hypothesis_compat.install()
OPERATIONS = ["createMessage", "countMessageTokens"]
SUPPRESS = [HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large]


def published() -> dict[str, Any]:
    with TestClient(create_app(FakeEngine(model_name=MODEL))) as c:
        return c.get("/openapi.json").json()


def test_the_routes_and_their_cache_fields_are_documented() -> None:
    spec = published()
    schemas = spec["components"]["schemas"]
    post = spec["paths"]["/v1/messages"]["post"]
    assert post["operationId"] == "createMessage"
    assert post["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith("/MessagesRequest")
    request = schemas["MessagesRequest"]
    assert {"max_tokens", "messages", "system", "tools", "tool_choice", "cache_control", "cache_salt"} <= set(
        request["properties"]
    )
    assert "max_tokens" in request["required"]
    assert set(schemas["CacheControl"]["properties"]) == {"type", "ttl"}
    usage = schemas["Usage"]
    assert {"cache_read_input_tokens", "cache_creation_input_tokens", "input_tokens"} <= set(
        usage["properties"]
    )
    assert "breakpoint" in usage["properties"]["cache_creation_input_tokens"]["description"]
    ok = post["responses"]["200"]["content"]["application/json"]["schema"]["$ref"]
    assert ok.endswith("/MessageResponse")
    assert post["responses"]["400"]["content"]["application/json"]["schema"]["$ref"].endswith(
        "/AnthropicError"
    )
    count = spec["paths"]["/v1/messages/count_tokens"]["post"]
    assert (
        count["operationId"] == "countMessageTokens"
        and "max_tokens" not in schemas["CountTokensRequest"]["properties"]
    )


@pytest.fixture(scope="session")
def messages_schema() -> schemathesis.BaseSchema:
    app = create_app(FakeEngine(model_name=MODEL, max_model_len=2048))
    return schemathesis.from_asgi("/openapi.json", app).include(operation_id=OPERATIONS)


schema = schemathesis.from_pytest_fixture("messages_schema")


def _nudge(body: object) -> None:
    """A useful share reaches generation: the served model, no stream (only JSON is validated), few tokens."""
    if not isinstance(body, dict):
        return
    body["model"] = MODEL
    body["stream"] = False
    if isinstance(body.get("max_tokens"), int) and not isinstance(body["max_tokens"], bool):
        body["max_tokens"] = max(1, min(body["max_tokens"], 16))


@schema.parametrize()
@settings(max_examples=25, deadline=None, suppress_health_check=SUPPRESS)
def test_generated_requests_never_get_a_5xx_and_answers_match(case: schemathesis.Case) -> None:
    _nudge(case.body)
    response = case.call()
    assert response.status_code < 500, response.text
    case.validate_response(response, checks=(not_a_server_error, response_schema_conformance))


@schema.parametrize(data_generation_methods=[schemathesis.DataGenerationMethod.negative])
@settings(max_examples=10, deadline=None, suppress_health_check=SUPPRESS)
def test_spec_violations_are_client_errors(case: schemathesis.Case) -> None:
    if isinstance(case.body, dict):
        case.body["stream"] = False
    response = case.call()
    assert response.status_code < 500, response.text
    assert response.json()["type"] == "error"
