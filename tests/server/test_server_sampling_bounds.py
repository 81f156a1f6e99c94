"""Sampling parameters whose float32 arithmetic would break are a 400 naming the parameter, on both
generation routes, before the engine sees them; the bounds themselves are accepted.

The bodies are sent as raw JSON text: Python's json (and so FastAPI) reads the literals NaN, Infinity and
-Infinity, and 1e-300 is a valid float64 that is 0 in float32 (the engine-kill repetition penalty)."""

from __future__ import annotations

import json

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import chat_body, completion_body

from engine.sampling_params import REPETITION_PENALTY_RANGE, SamplingParams

ROUTES = {
    "/v1/chat/completions": chat_body,
    "/v1/completions": completion_body,
}

REFUSED = [
    ("repetition_penalty", "1e-300"),
    ("repetition_penalty", "0"),
    ("repetition_penalty", "0.009"),
    ("repetition_penalty", "100.5"),
    ("repetition_penalty", "Infinity"),
    ("repetition_penalty", "NaN"),
    ("temperature", "NaN"),
    ("temperature", "Infinity"),
    ("temperature", "-1e-9"),
    ("temperature", "2.0001"),
    ("top_p", "NaN"),
    ("top_p", "1.5"),
    ("top_p", "-Infinity"),
    ("min_p", "NaN"),
    ("min_p", "1.01"),
    ("presence_penalty", "NaN"),
    ("presence_penalty", "-Infinity"),
    ("presence_penalty", "2.5"),
    ("frequency_penalty", "Infinity"),
    ("frequency_penalty", "-2.01"),
]


def _raw(body: dict, field: str, literal: str) -> str:
    body = dict(body)
    body[field] = "@@"
    return json.dumps(body).replace('"@@"', literal)


@pytest.mark.parametrize("path", sorted(ROUTES))
@pytest.mark.parametrize(("field", "literal"), REFUSED, ids=lambda v: str(v))
def test_a_value_that_breaks_float32_arithmetic_is_a_400_naming_it(
    client: TestClient, engine: FakeEngine, path: str, field: str, literal: str
) -> None:
    r = client.post(
        path, content=_raw(ROUTES[path](), field, literal), headers={"content-type": "application/json"}
    )
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["param"] == field and error["type"] == "invalid_request_error"
    assert engine.calls == []


ACCEPTED = [
    ("repetition_penalty", REPETITION_PENALTY_RANGE[0]),
    ("repetition_penalty", REPETITION_PENALTY_RANGE[1]),
    ("temperature", 2.0),
    ("temperature", 0.0),
    ("min_p", 1.0),
    ("presence_penalty", -2.0),
    ("frequency_penalty", 2.0),
]


@pytest.mark.parametrize("path", sorted(ROUTES))
@pytest.mark.parametrize(("field", "value"), ACCEPTED, ids=lambda v: str(v))
def test_the_bounds_themselves_are_accepted(client: TestClient, path: str, field: str, value: float) -> None:
    r = client.post(path, json=ROUTES[path](**{field: value}))
    assert r.status_code == 200, r.text


@pytest.mark.parametrize(
    "change",
    [
        {"temperature": float("nan")},
        {"top_p": float("nan")},
        {"min_p": float("inf")},
        {"presence_penalty": float("nan")},
        {"frequency_penalty": float("-inf")},
        {"repetition_penalty": 1e-300},
        {"repetition_penalty": float("inf")},
        {"repetition_penalty": float("nan")},
    ],
    ids=str,
)
def test_the_engine_refuses_them_too(change: dict) -> None:
    """SamplingParams.validate is the engine's own last line of defence (other front ends build params)."""
    with pytest.raises(ValueError, match=next(iter(change))):
        SamplingParams(**change).validate()
