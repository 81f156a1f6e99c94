"""Property tests of the Responses routes (fake engine, in process): no generated request gets a 5xx.
(GET and DELETE have no field a negative case could break: they run in the positive test only.)

Two sources of requests: Brine's own `/openapi.json` (createResponse, getResponse, deleteResponse; valid and
spec-violating bodies), and OpenAI's published `CreateResponse` where the full spec is beside the checkout
(its input items, tools and formats are far richer than ours: most of them must be a clean 4xx). Bodies are
nudged only so that a share reaches generation: the served model, no streaming, a small max_output_tokens.
"""

from __future__ import annotations

from pathlib import Path

import hypothesis_compat
import pytest
import schemathesis
from fake_engine import FakeEngine
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from server_helpers import MODEL

from server.app import create_app

FULL_SPEC = Path(__file__).resolve().parents[3] / "shared" / "openai-openapi.yaml"
OURS = ["createResponse", "getResponse", "deleteResponse"]
SETTINGS = settings(
    max_examples=20,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)

schemathesis.experimental.OPEN_API_3_1.enable()
hypothesis_compat.install()


def _app():  # type: ignore[no-untyped-def]
    return create_app(FakeEngine(model_name=MODEL, max_model_len=2048))


@pytest.fixture(scope="session")
def brine_schema() -> schemathesis.BaseSchema:
    app = _app()
    return schemathesis.from_dict(app.openapi(), app=app).include(operation_id=OURS)


@pytest.fixture(scope="session")
def openai_schema() -> schemathesis.BaseSchema:
    if not FULL_SPEC.is_file():
        pytest.skip(f"{FULL_SPEC} is not beside this checkout")
    return schemathesis.from_path(str(FULL_SPEC), app=_app()).include(operation_id="createResponse")


brine = schemathesis.from_pytest_fixture("brine_schema")
openai_spec = schemathesis.from_pytest_fixture("openai_schema")


def _nudge(case: schemathesis.Case) -> None:
    body = case.body
    if not isinstance(body, dict):
        return
    body["model"] = MODEL
    body["stream"] = False
    value = body.get("max_output_tokens")
    if isinstance(value, int) and not isinstance(value, bool) and value > 16:
        body["max_output_tokens"] = 16


@brine.parametrize()
@SETTINGS
def test_brines_own_schema_never_gets_a_5xx(case: schemathesis.Case) -> None:
    _nudge(case)
    response = case.call()
    assert response.status_code < 500, response.text
    case.validate_response(response, checks=(not_a_server_error,))


@brine.include(operation_id="createResponse").parametrize(
    data_generation_methods=[schemathesis.DataGenerationMethod.negative]
)
@SETTINGS
def test_violations_of_brines_schema_are_client_errors(case: schemathesis.Case) -> None:
    if isinstance(case.body, dict):
        case.body["stream"] = False
    response = case.call()
    assert response.status_code < 500, response.text


@openai_spec.parametrize()
@SETTINGS
def test_openais_create_response_bodies_never_get_a_5xx(case: schemathesis.Case) -> None:
    _nudge(case)
    response = case.call()
    assert response.status_code < 500, response.text
