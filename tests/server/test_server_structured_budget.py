"""A request its own grammar failed (masks over --grammar-mask-budget-ms) is told why: a 400 in OpenAI's shape
naming the field that carried the constraint and the budget, or the same error as the stream's last event
once it has started; any other engine failure still tells the client nothing of the engine's insides."""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import MODEL, assert_error, chat_body, completion_body, sse_events

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from engine.structured_spec import GrammarTooSlowError
from server.app import create_app

SCHEMA = {"type": "json_schema", "json_schema": {"name": "c", "schema": {"type": "object"}}}
# What the engine's scheduler records when a request's masks go over the budget (the exception's repr).
BUDGET_ERROR = repr(GrammarTooSlowError(0.0123, 0.010, 1))


class GrammarFailingEngine(FakeEngine):
    """Fails constrained requests after two steps, as a grammar whose mask cost grows does; others run."""

    async def generate(  # type: ignore[override]
        self, prompt_token_ids: list[int], params: SamplingParams, **kwargs: Any
    ) -> AsyncIterator[RequestOutput]:
        self.error_after = 2 if params.structured is not None else None
        async for out in super().generate(prompt_token_ids, params, **kwargs):
            if out.error is not None:
                out.error = BUDGET_ERROR
            yield out


@pytest.fixture
def client() -> Iterator[TestClient]:
    with TestClient(create_app(GrammarFailingEngine(model_name=MODEL))) as c:
        yield c


def _says_budget(err: dict[str, Any]) -> None:
    assert err["code"] == "grammar_mask_budget_exceeded"
    assert "per-token mask budget" in err["message"] and "--grammar-mask-budget-ms" in err["message"]


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", chat_body(max_tokens=10, response_format=SCHEMA), "response_format"),
        ("/v1/chat/completions", chat_body(max_tokens=10, guided_json={"type": "object"}), "guided_json"),
        ("/v1/completions", completion_body(max_tokens=10, guided_regex="[a-z]+"), "guided_regex"),
    ],
)
def test_a_request_over_the_mask_budget_is_a_400_naming_its_constraint(
    client: TestClient, path: str, body: dict[str, Any], param: str
) -> None:
    err = assert_error(client.post(path, json=body), 400, param=param)
    _says_budget(err)
    free = client.post(path, json={k: v for k, v in body.items() if k not in (param, "response_format")})
    assert free.status_code == 200, free.text  # the server goes on


def test_a_stream_over_the_mask_budget_ends_with_that_error(client: TestClient) -> None:
    r = client.post(
        "/v1/chat/completions", json=chat_body(max_tokens=10, response_format=SCHEMA, stream=True)
    )
    assert r.status_code == 200
    events = sse_events(r.text)
    assert events[-1] == "[DONE]"
    err = events[-2]["error"]
    assert set(err) == {"message", "type", "param", "code"} and err["type"] == "invalid_request_error"
    assert err["param"] == "response_format"
    _says_budget(err)


def test_any_other_engine_failure_still_tells_nothing() -> None:
    engine = FakeEngine(model_name=MODEL, error_after=2)
    with TestClient(create_app(engine)) as c:
        r = c.post("/v1/chat/completions", json=chat_body(max_tokens=10, response_format=SCHEMA))
    err = assert_error(r, 500)
    assert err["code"] is None and "fake engine failure" not in err["message"]
