"""ApiKeyMiddleware edges that `make mutate` found untested: the 401's exact shape and challenge header,
lifespan (and other non-HTTP) scopes passing through untouched, empty keys meaning no key, and whitespace
around the token."""

from __future__ import annotations

from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from server.app import create_app

KEYS = ["key-one", "key-two"]


def test_the_401_says_how_to_authenticate(engine: FakeEngine) -> None:
    with TestClient(create_app(engine, api_keys=KEYS)) as client:  # lifespan runs: startup is not a request
        r = client.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json() == {
        "error": {
            "message": "Incorrect API key provided: pass it as 'Authorization: Bearer <key>'.",
            "type": "invalid_request_error",
            "param": None,
            "code": "invalid_api_key",
        }
    }


def test_empty_keys_are_no_keys(engine: FakeEngine) -> None:
    # An empty --api-key must not become a key that "Bearer " plus spaces would match.
    with TestClient(create_app(engine, api_keys=[""])) as client:
        assert client.get("/v1/models").status_code == 200
    with TestClient(create_app(engine, api_keys=["", "key-one"])) as client:
        assert client.get("/v1/models", headers={"Authorization": "Bearer  "}).status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer key-one"}).status_code == 200


def test_spaces_around_the_token_are_not_part_of_it(engine: FakeEngine) -> None:
    with TestClient(create_app(engine, api_keys=KEYS)) as client:
        for header in ("Bearer  key-one", "bearer key-two ", "BEARER key-one"):
            assert client.get("/v1/models", headers={"Authorization": header}).status_code == 200, header
        assert client.get("/v1/models", headers={"Authorization": "Bearer key-one x"}).status_code == 401


def test_only_get_and_head_of_health_are_open(engine: FakeEngine) -> None:
    with TestClient(create_app(engine, api_keys=KEYS)) as client:
        assert client.get("/health").status_code == 200
        assert client.head("/health").status_code != 401  # open (the route itself may not serve HEAD)
        assert client.post("/health").status_code == 401  # another method on an open path is not open
        assert client.get("/health/").status_code == 401
