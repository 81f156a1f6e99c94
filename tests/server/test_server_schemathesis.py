"""Property tests from OpenAI's published spec: for generated createChatCompletion, createCompletion and
listModels requests, the server never answers 5xx and every documented (200) JSON response matches the schema.

Runs in-process over ASGI with the fake engine, on the committed subset of the spec (spec_subset.py: the three
operations and what they reference), so it runs wherever the repository is checked out alone. Requests are
generated from the spec, then nudged so that a useful share reaches generation: the model is set to the served
one (otherwise nearly all would be 404s), stream is forced off (only JSON responses are validated), n /
max_tokens are capped so a case stays fast, and a completion's prompt keeps its generated shape but is made
runnable (present, non-empty, token ids inside the vocabulary, no `suffix`): left random, only ~1 in 4
completion cases got a 200, so the response-schema check hardly ever ran on a real answer. Everything else
is left as generated. A second, smaller run uses
schemathesis' negative mode (bodies that violate the spec) and only checks that none of them gets a 5xx.
"""

from __future__ import annotations

from pathlib import Path

import hypothesis_compat
import pytest
import schemathesis
import spec_subset
import yaml
from fake_engine import FakeEngine
from fake_tokenizer import FakeTokenizer
from hypothesis import HealthCheck, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import response_schema_conformance
from server_helpers import MODEL

from server.app import create_app

HERE = Path(__file__).resolve().parent
SPEC = HERE / "openai-openapi-subset.yaml"
FULL_SPEC = HERE.parents[2] / "shared" / "openai-openapi.yaml"  # beside the checkout, where there is one
OPERATIONS = list(spec_subset.OPERATIONS)
MAX_EXAMPLES = 40
NEGATIVE_EXAMPLES = 10

# The spec is OpenAPI 3.1, which schemathesis 3.x supports behind this switch.
schemathesis.experimental.OPEN_API_3_1.enable()
hypothesis_compat.install()


@pytest.fixture(scope="session")
def openai_schema() -> schemathesis.BaseSchema:
    app = create_app(FakeEngine(model_name=MODEL, max_model_len=2048))
    return schemathesis.from_path(str(SPEC), app=app).include(operation_id=OPERATIONS)


schema = schemathesis.from_pytest_fixture("openai_schema")


def _nudge(body: object, path: str) -> None:
    if not isinstance(body, dict):
        return
    if path == "/completions":
        _nudge_prompt(body)
    body["model"] = MODEL
    body["stream"] = False
    for key, cap in (("n", 2), ("max_tokens", 16), ("max_completion_tokens", 16)):
        value = body.get(key)
        if isinstance(value, int) and not isinstance(value, bool) and value > cap:
            body[key] = cap


VOCAB = FakeTokenizer.vocab_size


def _runnable(part: object) -> object:
    """One prompt (a string, or token ids) that the model can run, keeping the generated shape."""
    if isinstance(part, list):
        return [t % VOCAB if isinstance(t, int) else t for t in part] or ["hello"]
    if isinstance(part, int) and not isinstance(part, bool):
        return part % VOCAB
    return part or "hello"


def _nudge_prompt(body: dict) -> None:
    body.pop("suffix", None)  # not supported: always a 400
    prompt = body.get("prompt")
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], list):
        body["prompt"] = [_runnable(p) for p in prompt]  # a batch of token-id prompts
    elif isinstance(prompt, list) and prompt and all(isinstance(p, str) for p in prompt):
        body["prompt"] = [p or "hello" for p in prompt]  # a batch of strings
    else:
        body["prompt"] = _runnable(prompt) if prompt is not None else "hello"


@schema.parametrize()
@settings(
    max_examples=MAX_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
def test_spec_conformance(case: schemathesis.Case) -> None:
    _nudge(case.body, case.path)
    response = case.call()
    assert response.status_code < 500, response.text
    case.validate_response(response, checks=(not_a_server_error, response_schema_conformance))


@schema.parametrize(data_generation_methods=[schemathesis.DataGenerationMethod.negative])
@settings(
    max_examples=NEGATIVE_EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much, HealthCheck.data_too_large],
)
def test_spec_violations_are_client_errors(case: schemathesis.Case) -> None:
    """Bodies that break the spec (wrong types, missing fields, out-of-range values) get a 4xx, never 5xx."""
    if isinstance(case.body, dict):
        case.body["stream"] = False
    response = case.call()
    assert response.status_code < 500, response.text
    case.validate_response(response, checks=(not_a_server_error,))


def test_committed_subset_matches_the_published_spec() -> None:
    if not FULL_SPEC.is_file():
        pytest.skip(f"{FULL_SPEC} is not beside this checkout")
    assert SPEC.read_text() == spec_subset.render(yaml.safe_load(FULL_SPEC.read_text())), (
        "regenerate tests/server/openai-openapi-subset.yaml with tests/server/spec_subset.py"
    )
