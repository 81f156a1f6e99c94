"""API keys on every route but /health, and the cache_salt rules (validated first, never echoed or logged)."""

from __future__ import annotations

import logging

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import assert_error, chat_body, completion_body

from metrics.prometheus import PrometheusStatLogger
from server.app import create_app

KEYS = ["key-one", "key-two"]
PROTECTED = [
    ("GET", "/v1/models", None),
    ("GET", "/version", None),
    ("GET", "/metrics", None),
    ("POST", "/tokenize", {"prompt": "hi"}),
    ("POST", "/detokenize", {"tokens": [70]}),
    ("POST", "/reset_prefix_cache", None),
    ("POST", "/v1/chat/completions", chat_body()),
    ("POST", "/v1/completions", completion_body()),
    ("GET", "/docs", None),
    ("GET", "/openapi.json", None),
    ("GET", "/no/such/route", None),
]


@pytest.fixture
def auth_client(engine: FakeEngine) -> TestClient:
    return TestClient(create_app(engine, api_keys=KEYS, metrics=PrometheusStatLogger("fake-model")))


@pytest.mark.parametrize(("method", "path", "body"), PROTECTED)
def test_every_route_needs_a_key(auth_client: TestClient, method: str, path: str, body: dict | None) -> None:
    for headers in (
        {},
        {"Authorization": "Bearer wrong"},
        {"Authorization": "key-one"},
        {"Authorization": "Basic key-one"},
        # A valid key must match whole: neither a longer token that starts with it nor a prefix of it.
        {"Authorization": "Bearer key-one<anything>"},
        {"Authorization": "Bearer key-twokey-one"},
        {"Authorization": "Bearer key-on"},
        {"Authorization": "Bearer key-one key-two"},
    ):
        r = auth_client.request(method, path, json=body, headers=headers)
        assert_error(r, 401, code="invalid_api_key")
    for key in KEYS:
        r = auth_client.request(method, path, json=body, headers={"Authorization": f"Bearer {key}"})
        assert r.status_code != 401, r.text
        assert r.status_code == (404 if path == "/no/such/route" else 200), r.text


def test_health_is_open(auth_client: TestClient) -> None:
    assert auth_client.get("/health").status_code == 200


def test_non_ascii_header_is_just_wrong(auth_client: TestClient, engine: FakeEngine) -> None:
    r = auth_client.get("/v1/models", headers={"Authorization": "Bearer clé".encode()})
    assert_error(r, 401, code="invalid_api_key")


def test_no_keys_no_auth(client: TestClient) -> None:
    assert client.get("/v1/models").status_code == 200


BAD_SALTS = ["", "s" * 1025, 7, None, ["a"], {"a": "b"}, True, 1.5]
ROUTES = [("/v1/chat/completions", chat_body), ("/v1/completions", completion_body)]


@pytest.mark.parametrize("salt", BAD_SALTS, ids=repr)
@pytest.mark.parametrize(("path", "make"), ROUTES)
def test_bad_salt_is_400_and_never_reaches_engine(
    client: TestClient, engine: FakeEngine, path: str, make, salt: object
) -> None:
    for stream in (False, True):
        err = assert_error(client.post(path, json=make(cache_salt=salt, stream=stream)), 400, "cache_salt")
        assert err["code"] == "invalid_cache_salt"
        if isinstance(salt, str) and salt:
            assert salt not in err["message"]
    assert engine.calls == []


@pytest.mark.parametrize(("path", "make"), ROUTES)
def test_bad_salt_wins_over_other_errors(client: TestClient, path: str, make) -> None:
    r = client.post(path, json=make(cache_salt="", model="unknown", temperature=9))
    assert_error(r, 400, "cache_salt")


@pytest.mark.parametrize(("path", "make"), ROUTES)
def test_good_salts_reach_engine(client: TestClient, engine: FakeEngine, path: str, make) -> None:
    for salt in ("t", "s" * 1024, "ünïcødé ☃"):
        assert client.post(path, json=make(cache_salt=salt)).status_code == 200
        assert engine.calls[-1].cache_salt == salt
    assert client.post(path, json=make()).status_code == 200
    assert engine.calls[-1].cache_salt is None


def test_each_request_hands_its_own_salt_to_the_engine_with_the_same_tokens(
    client: TestClient, engine: FakeEngine
) -> None:
    # Isolation itself is the cache's (tests/kv_cache, tests/engine/test_async_engine.py, tests/e2e); the
    # server's part is to give the engine every prompt of a request with that request's salt, and the same
    # token ids whatever the salt, so that the salt alone decides a hit.
    prefix = "a shared and fairly long prefix " * 3
    sent: list[str | None] = []
    for salt in ("tenant-a", "tenant-b", None, "tenant-a"):
        extra = {} if salt is None else {"cache_salt": salt}
        for stream in (False, True):
            body = completion_body([prefix + "1", prefix + "2"], stream=stream, **extra)
            assert client.post("/v1/completions", json=body).status_code == 200
            sent += [salt, salt]
            assert (
                client.post(
                    "/v1/chat/completions", json=chat_body(prefix, stream=stream, **extra)
                ).status_code
                == 200
            )
            sent.append(salt)
    assert [c.cache_salt for c in engine.calls] == sent
    assert len({tuple(c.prompt_token_ids) for c in engine.calls}) == 3  # two completion prompts, one chat


def test_salt_is_never_logged(
    client: TestClient, caplog: pytest.LogCaptureFixture, engine: FakeEngine
) -> None:
    secret = "tenant-secret-7f3a"
    caplog.set_level(logging.DEBUG)
    engine.error_after = 1  # exercise the error-logging path too
    client.post("/v1/completions", json=completion_body(cache_salt=secret))
    client.post("/v1/chat/completions", json=chat_body(cache_salt=secret, stream=True))
    client.post("/v1/chat/completions", json=chat_body(cache_salt=secret + "x" * 1100))
    assert caplog.records  # the error paths did log something
    assert all(secret not in r.getMessage() and secret not in (r.exc_text or "") for r in caplog.records)
