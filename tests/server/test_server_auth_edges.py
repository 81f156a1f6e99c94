"""ApiKeyMiddleware edges that `make mutate` found untested: the 401's exact shape and challenge header,
lifespan (and other non-HTTP) scopes passing through untouched, empty keys meaning no key, and whitespace
around the token."""

from __future__ import annotations

import asyncio

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient

from server.app import create_app
from server.auth import ApiKeyMiddleware
from server.tenancy import TenancyConfig
from server.tenants import key_hash

KEYS = ["key-one", "key-two"]


def test_the_401_says_how_to_authenticate(engine: FakeEngine) -> None:
    with TestClient(create_app(engine, api_keys=KEYS)) as client:  # lifespan runs: startup is not a request
        r = client.get("/v1/models", headers={"Authorization": "Bearer nope"})
    assert r.status_code == 401
    assert r.headers["www-authenticate"] == "Bearer"
    assert r.json() == {
        "error": {
            "message": "Incorrect API key provided: pass it as 'Authorization: Bearer <key>' or "
            "'x-api-key: <key>'.",
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


def test_an_unknown_scope_type_is_refused_by_name() -> None:
    async def app(scope, receive, send):  # never reached
        raise AssertionError("the app was called")

    async def nothing():
        return {}

    middleware = ApiKeyMiddleware(app, KEYS)
    with pytest.raises(RuntimeError) as e:
        asyncio.run(middleware({"type": "telepathy"}, nothing, nothing))
    assert str(e.value) == "unsupported ASGI scope type 'telepathy'"


def test_no_token_is_never_a_tenant_even_one_listed_under_the_empty_keys_hash(engine: FakeEngine) -> None:
    # A tenants file may list any 64-hex digest, that of "" too: no Authorization header must still be a 401,
    # never that tenant.
    tenants = {key_hash(""): "nobody"}
    with TestClient(create_app(engine, api_keys=KEYS, tenancy=TenancyConfig(tenants=tenants))) as client:
        assert client.get("/v1/models").status_code == 401
        assert client.get("/v1/models", headers={"Authorization": "Bearer "}).status_code == 401


def test_a_tenant_on_an_operator_route_gets_the_403_body(engine: FakeEngine) -> None:
    with TestClient(
        create_app(engine, api_keys=KEYS, tenancy=TenancyConfig(tenants={key_hash("t-key"): "acme"}))
    ) as client:
        r = client.get("/metrics", headers={"Authorization": "Bearer t-key"})
    assert r.status_code == 403
    assert r.json() == {
        "error": {
            "message": "This route is the server operator's: a tenant's API key cannot use it.",
            "type": "invalid_request_error",
            "param": None,
            "code": "permission_denied",
        }
    }
