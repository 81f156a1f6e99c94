"""Stored responses: one namespace's responses are invisible to every other (a 404 on GET / DELETE, the
same 400 as a missing id on previous_response_id), and the store's bound and TTL."""

from __future__ import annotations

from typing import Any

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import MODEL, assert_error

from kv_cache.namespace import CacheNamespace
from server.app import create_app
from server.response_store import ResponseStore, StoreLimits
from server.tenancy import TenancyConfig
from server.tenants import key_hash

OPERATOR = "operator-key"
ACME, GLOBEX = "sk-acme-key", "sk-globex-key"


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
def tenant_client(engine: FakeEngine) -> TestClient:
    tenancy = TenancyConfig(tenants={key_hash(ACME): "acme", key_hash(GLOBEX): "globex"})
    return TestClient(create_app(engine, api_keys=[OPERATOR], tenancy=tenancy))


def create(client: TestClient, key: str, **extra: Any) -> dict[str, Any]:
    body = {"model": MODEL, "input": "hello", "max_output_tokens": 4, **extra}
    r = client.post("/v1/responses", json=body, headers=bearer(key))
    assert r.status_code == 200, r.text
    return r.json()


def test_another_tenants_response_is_a_404_never_a_403(tenant_client: TestClient, engine: FakeEngine) -> None:
    mine = create(tenant_client, ACME)
    assert engine.calls[-1].namespace == CacheNamespace(tenant="acme")
    path = f"/v1/responses/{mine['id']}"
    for key in (GLOBEX, OPERATOR):  # the operator's own namespace is not the tenant's either
        assert_error(tenant_client.get(path, headers=bearer(key)), 404, "response_id", "not_found")
        assert_error(tenant_client.delete(path, headers=bearer(key)), 404, "response_id", "not_found")
        r = tenant_client.post(
            "/v1/responses",
            json={"model": MODEL, "input": "next", "previous_response_id": mine["id"]},
            headers=bearer(key),
        )
        missing = tenant_client.post(
            "/v1/responses",
            json={"model": MODEL, "input": "next", "previous_response_id": "resp_" + "0" * 32},
            headers=bearer(key),
        )
        # Exactly what a missing id gets: nothing tells the caller the id exists.
        assert r.status_code == missing.status_code == 400 and r.json() == missing.json()
        assert_error(r, 400, "previous_response_id", "previous_response_not_found")
    # The owner still sees it (the failed DELETEs deleted nothing), continues it, then deletes it.
    assert tenant_client.get(path, headers=bearer(ACME)).json() == mine
    create(tenant_client, ACME, previous_response_id=mine["id"], input="next")
    assert tenant_client.delete(path, headers=bearer(ACME)).json() == {
        "id": mine["id"],
        "object": "response.deleted",
        "deleted": True,
    }
    assert_error(tenant_client.get(path, headers=bearer(ACME)), 404, "response_id", "not_found")


def test_a_salted_response_belongs_to_its_salt(tenant_client: TestClient) -> None:
    mine = create(tenant_client, ACME, cache_salt="user-1")
    path = f"/v1/responses/{mine['id']}"
    assert tenant_client.get(path, params={"cache_salt": "user-1"}, headers=bearer(ACME)).json() == mine
    for params in ({}, {"cache_salt": "user-2"}):
        assert_error(tenant_client.get(path, params=params, headers=bearer(ACME)), 404, "response_id")
    assert_error(
        tenant_client.get(path, params={"cache_salt": "user-1"}, headers=bearer(GLOBEX)), 404, "response_id"
    )
    assert_error(
        tenant_client.get(path, params={"cache_salt": ""}, headers=bearer(ACME)),
        400,
        "cache_salt",
        "invalid_cache_salt",
    )
    r = tenant_client.post(
        "/v1/responses",
        json={"model": MODEL, "input": "next", "previous_response_id": mine["id"], "cache_salt": "user-2"},
        headers=bearer(ACME),
    )
    assert_error(r, 400, "previous_response_id", "previous_response_not_found")
    create(tenant_client, ACME, cache_salt="user-1", previous_response_id=mine["id"], input="next")


def test_the_store_is_bounded_and_forgets_the_oldest_first() -> None:
    now = [0.0]
    store = ResponseStore(StoreLimits(max_entries=2, max_bytes=1_000, ttl_s=60), clock=lambda: now[0])
    ns = CacheNamespace(tenant="acme")
    for i in range(3):
        assert store.put(f"r{i}", ns, {"id": f"r{i}"}, [])
        now[0] += 1
    assert store.get("r0", ns) is None and store.get("r1", ns) is not None and len(store) == 2
    big = {"id": "big", "text": "x" * 965}  # 992 bytes of JSON with its items
    assert store.put("big", ns, big, [])  # over the byte bound together with the others: they go first
    assert store.get("r1", ns) is None and store.get("r2", ns) is None and store.num_bytes <= 1_000
    assert not store.put("huge", ns, {"text": "x" * 2_000}, [])  # larger than the bound alone: not kept
    assert store.get("huge", ns) is None and store.get("big", ns) is not None


def test_stored_responses_expire_after_the_ttl() -> None:
    now = [0.0]
    store = ResponseStore(StoreLimits(ttl_s=10), clock=lambda: now[0])
    store.put("old", None, {"id": "old"}, [])
    now[0] = 5
    store.put("new", None, {"id": "new"}, [])
    now[0] = 10.5
    assert store.get("old", None) is None and store.get("new", None) is not None
    assert not store.delete("old", None) and len(store) == 1
    now[0] = 16
    assert store.get("new", None) is None and len(store) == 0 and store.num_bytes == 0


def test_a_namespace_sees_only_its_own_entries() -> None:
    store = ResponseStore()
    store.put("r", CacheNamespace(tenant="acme", salt="s"), {"id": "r"}, [])
    for other in (
        None,
        CacheNamespace(tenant="acme"),
        CacheNamespace(salt="s"),
        CacheNamespace(gateway="acme"),
    ):
        assert store.get("r", other) is None and not store.delete("r", other)
    assert store.delete("r", CacheNamespace(tenant="acme", salt="s")) and len(store) == 0


def test_a_tenant_that_floods_the_store_evicts_its_own_responses_not_anothers() -> None:
    """Past the bound the holder storing the most gives up its oldest: a probe's 10,000 stored responses from
    one tenant evicted another tenant's one when the store's oldest went first. A tenant's salts are one
    holder, so rotating them does not help it; and the bytes bound is held the same way."""
    now = [0.0]
    store = ResponseStore(StoreLimits(max_entries=4, max_bytes=10_000, ttl_s=60), clock=lambda: now[0])
    victim = CacheNamespace(tenant="globex")
    assert store.put("theirs", victim, {"id": "theirs"}, [])
    for i in range(20):
        now[0] += 1
        assert store.put(f"flood{i}", CacheNamespace(tenant="acme", salt=f"s{i % 3}"), {"id": f"f{i}"}, [])
    assert store.get("theirs", victim) is not None and len(store) == 4
    flood = [f"flood{i}" for i in range(20)]  # acme kept its newest three
    assert [
        i for i in flood if store.get(i, CacheNamespace(tenant="acme", salt=f"s{int(i[5:]) % 3}"))
    ] == flood[-3:]

    by_bytes = ResponseStore(StoreLimits(max_entries=100, max_bytes=600), clock=lambda: now[0])
    assert by_bytes.put("small", victim, {"id": "small"}, [])
    for i in range(5):
        assert by_bytes.put(f"big{i}", CacheNamespace(tenant="acme"), {"id": "x" * 150}, [])
    assert by_bytes.get("small", victim) is not None and by_bytes.num_bytes <= 600
    assert by_bytes.get("big4", CacheNamespace(tenant="acme")) is not None
    assert by_bytes.get("big0", CacheNamespace(tenant="acme")) is None
    # A response that would make its own holder the largest is the one that goes: put says it was not kept.
    initech = CacheNamespace(tenant="initech")
    assert (
        not by_bytes.put("bigger", initech, {"id": "y" * 440}, []) and by_bytes.get("bigger", initech) is None
    )
    assert by_bytes.get("small", victim) is not None and by_bytes.num_bytes <= 600
