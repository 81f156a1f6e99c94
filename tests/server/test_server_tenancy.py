"""Tenancy at the HTTP layer (fake engine): tenants' keys and their namespaces, the operator's routes, the
gateway header, --require-cache-salt, tenant-scoped resets, the tenants file and `brine tenant-key`."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from fake_engine import FakeEngine
from fastapi.testclient import TestClient
from server_helpers import assert_error, chat_body, completion_body

from kv_cache.namespace import CacheNamespace
from metrics.prometheus import PrometheusStatLogger
from server.app import create_app
from server.cli import main
from server.public_prefix import PublicPrefixError, read_public_prefix, render_public_prefix
from server.tenancy import TenancyConfig
from server.tenants import TenantsFileError, key_hash, load_tenants, new_tenant_key, parse_tenants

OPERATOR = "operator-key"
ACME, GLOBEX = "sk-acme-key", "sk-globex-key"
TENANTS = {key_hash(ACME): "acme", key_hash(GLOBEX): "globex"}


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def make_client(engine: FakeEngine, **tenancy: object) -> TestClient:
    config = TenancyConfig(**tenancy)  # type: ignore[arg-type]
    app = create_app(engine, api_keys=[OPERATOR], metrics=PrometheusStatLogger("fake-model"), tenancy=config)
    return TestClient(app)


@pytest.fixture
def tenant_client(engine: FakeEngine) -> TestClient:
    return make_client(engine, tenants=dict(TENANTS))


def test_a_tenant_key_runs_in_its_namespace_and_the_salt_partitions_inside(
    tenant_client: TestClient, engine: FakeEngine
) -> None:
    for key, body, expected in (
        (ACME, completion_body(), CacheNamespace(tenant="acme")),
        (ACME, chat_body(cache_salt="user-1"), CacheNamespace(tenant="acme", salt="user-1")),
        (GLOBEX, completion_body(cache_salt="user-1"), CacheNamespace(tenant="globex", salt="user-1")),
        (OPERATOR, completion_body(cache_salt="user-1"), CacheNamespace(salt="user-1")),
        (OPERATOR, completion_body(), None),
    ):
        path = "/v1/chat/completions" if "messages" in body else "/v1/completions"
        r = tenant_client.post(path, json=body, headers=bearer(key))
        assert r.status_code == 200, r.text
        assert engine.calls[-1].namespace == expected


def test_same_prompt_and_salt_never_hit_across_tenants(tenant_client: TestClient) -> None:
    prompt = "one two three four five six seven eight nine ten eleven twelve"

    def cached(key: str) -> int:
        body = completion_body(prompt, cache_salt="same", max_tokens=2)
        r = tenant_client.post("/v1/completions", json=body, headers=bearer(key))
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached(ACME) == 0
    assert cached(ACME) > 0
    assert cached(GLOBEX) == 0


@pytest.mark.parametrize(
    ("method", "path", "body", "tenant_status"),
    [
        ("GET", "/v1/models", None, 200),
        ("GET", "/v1/models/fake-model", None, 200),
        ("POST", "/tokenize", {"prompt": "hi"}, 200),
        ("POST", "/detokenize", {"tokens": [70]}, 200),
        ("POST", "/v1/completions", completion_body(), 200),
        ("POST", "/v1/chat/completions", chat_body(), 200),
        ("GET", "/version", None, 200),
        ("GET", "/openapi.json", None, 200),
        ("POST", "/reset_prefix_cache", None, 200),  # scoped to the tenant
        ("GET", "/metrics", None, 403),
        ("GET", "/no/such/route", None, 403),  # every route not listed is the operator's
    ],
)
def test_tenant_routes_and_operator_routes(
    tenant_client: TestClient, method: str, path: str, body: dict | None, tenant_status: int
) -> None:
    r = tenant_client.request(method, path, json=body, headers=bearer(ACME))
    if tenant_status == 403:
        err = assert_error(r, 403, code="permission_denied")
        assert err["message"] == "This route is the server operator's: a tenant's API key cannot use it."
    else:
        assert r.status_code == tenant_status, r.text
    operator = tenant_client.request(method, path, json=body, headers=bearer(OPERATOR))
    assert operator.status_code == (404 if path == "/no/such/route" else 200), operator.text
    for headers in ({}, bearer("sk-unknown"), {"Authorization": ACME}):
        assert_error(
            tenant_client.request(method, path, json=body, headers=headers), 401, code="invalid_api_key"
        )
    assert tenant_client.get("/health").status_code == 200


def test_tenants_without_operator_keys_still_need_a_key(engine: FakeEngine) -> None:
    client = TestClient(create_app(engine, tenancy=TenancyConfig(tenants=dict(TENANTS))))
    assert_error(client.get("/v1/models"), 401)
    assert client.get("/v1/models", headers=bearer(ACME)).status_code == 200
    assert_error(client.get("/metrics", headers=bearer(ACME)), 403)
    empty = TestClient(create_app(engine, tenancy=TenancyConfig(tenants={})))  # --tenants with no lines
    assert_error(empty.get("/v1/models"), 401)


def test_tenant_reset_forgets_only_its_own_blocks(tenant_client: TestClient, engine: FakeEngine) -> None:
    prompt = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu"
    body = completion_body(prompt, max_tokens=2)

    def cached(key: str) -> int:
        r = tenant_client.post("/v1/completions", json=body, headers=bearer(key))
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    for key in (ACME, GLOBEX, OPERATOR):
        cached(key)
    warm = cached(GLOBEX)
    assert warm > 0
    r = tenant_client.post("/reset_prefix_cache", headers=bearer(ACME))
    assert r.status_code == 200, r.text
    assert r.json()["reset"] is True and r.json()["forgotten_blocks"] > 0
    assert cached(ACME) == 0
    assert cached(GLOBEX) == warm and cached(OPERATOR) == warm
    again = tenant_client.post("/reset_prefix_cache", headers=bearer(GLOBEX)).json()
    assert again["forgotten_blocks"] > 0
    # The operator's reset is global and answers as before.
    assert tenant_client.post("/reset_prefix_cache", headers=bearer(OPERATOR)).json() == {"reset": True}


def test_gateway_header_sets_the_namespace(engine: FakeEngine) -> None:
    client = make_client(engine, salt_header="X-Brine-Tenant")
    ok = client.post("/v1/completions", json=completion_body(cache_salt="u"), headers={
        **bearer(OPERATOR), "x-brine-tenant": "team-7"})  # fmt: skip
    assert ok.status_code == 200, ok.text
    assert engine.calls[-1].namespace == CacheNamespace(gateway="team-7", salt="u")
    for headers, code in (
        ({}, "missing_header"),
        ({"X-Brine-Tenant": "x" * 1025}, "invalid_header"),
        ({"X-Brine-Tenant": ""}, "invalid_header"),
    ):
        for path, body in (("/v1/completions", completion_body()), ("/v1/chat/completions", chat_body())):
            r = client.post(path, json=body, headers={**bearer(OPERATOR), **headers})
            err = assert_error(r, 400, param="x-brine-tenant", code=code)
            assert "xxxx" not in err["message"]
    # Sent twice (a gateway that appends its header to the client's): neither is trusted; once the first won.
    twice = [*bearer(OPERATOR).items(), ("X-Brine-Tenant", "team-1"), ("x-brine-tenant", "team-7")]
    r = client.post("/v1/completions", json=completion_body(), headers=twice)
    assert "team" not in assert_error(r, 400, param="x-brine-tenant", code="invalid_header")["message"]
    # With the header, a reset is the gateway tenant's own; without it, the operator's global one.
    r = client.post("/reset_prefix_cache", headers={**bearer(OPERATOR), "X-Brine-Tenant": "team-7"})
    assert r.status_code == 200 and "forgotten_blocks" in r.json()
    assert client.post("/reset_prefix_cache", headers=bearer(OPERATOR)).json() == {"reset": True}


def test_a_tenant_key_wins_over_the_gateway_header(engine: FakeEngine) -> None:
    client = make_client(engine, tenants=dict(TENANTS), salt_header="x-tenant")
    r = client.post("/v1/completions", json=completion_body(), headers={**bearer(ACME), "x-tenant": "globex"})
    assert r.status_code == 200
    assert engine.calls[-1].namespace == CacheNamespace(tenant="acme")


def test_require_cache_salt(engine: FakeEngine) -> None:
    client = make_client(engine, tenants=dict(TENANTS), require_cache_salt=True)
    for path, body in (("/v1/completions", completion_body()), ("/v1/chat/completions", chat_body())):
        assert_error(
            client.post(path, json=body, headers=bearer(OPERATOR)), 400, "cache_salt", "missing_cache_salt"
        )
        assert (
            client.post(path, json={**body, "cache_salt": "s"}, headers=bearer(OPERATOR)).status_code == 200
        )
        assert client.post(path, json=body, headers=bearer(ACME)).status_code == 200  # the tenant is one
    # A bad salt is still reported as a bad salt.
    bad = client.post("/v1/completions", json=completion_body(cache_salt=""), headers=bearer(OPERATOR))
    assert_error(bad, 400, "cache_salt", "invalid_cache_salt")
    assert not [c for c in engine.calls if c.namespace is None]


def test_bad_salt_header_names_are_refused() -> None:
    for name in ("", "has space", "Authorization", "x:y"):
        with pytest.raises(ValueError):
            TenancyConfig(salt_header=name)


def test_tenants_file_parsing(tmp_path: Path) -> None:
    digest = key_hash("k")
    text = f"# tenants\n\nacme {digest}\n  acme   {key_hash('k2')}  \nglobex {key_hash('k3')}\n"
    assert parse_tenants(text) == {digest: "acme", key_hash("k2"): "acme", key_hash("k3"): "globex"}
    bad_lines = [
        "acme",  # one field
        f"acme {digest} extra",
        f"acme {digest.upper()}",  # must be lowercase
        f"acme {digest[:-1]}",
        f"globex {digest}",  # the key already belongs to acme (line 1)
    ]
    for bad in bad_lines:
        path = tmp_path / "tenants.txt"
        path.write_text(f"acme {digest}\n# comment\n\n{bad}\n")
        with pytest.raises(TenantsFileError) as exc:
            load_tenants(path)
        assert "line 4" in str(exc.value)
        assert "acme" not in str(exc.value) and "globex" not in str(exc.value)  # never names a tenant
    with pytest.raises(TenantsFileError):
        load_tenants(tmp_path / "missing.txt")


def test_tenant_key_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["tenant-key", "acme"]) == 0
    out = capsys.readouterr().out.splitlines()
    key = out[0].rsplit(" ", 1)[1]
    assert key.startswith("sk-brine-") and len(key) > 40
    assert parse_tenants(out[-1]) == {key_hash(key): "acme"}
    assert new_tenant_key("acme")[0] != key  # random every time
    assert main(["tenant-key", "#acme"]) == 2
    assert main(["tenant-key", ""]) == 2


def test_tenant_never_reaches_a_log(tenant_client: TestClient, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG)
    tenant_client.post("/v1/completions", json=completion_body(cache_salt="s"), headers=bearer(ACME))
    tenant_client.post("/reset_prefix_cache", headers=bearer(ACME))
    tenant_client.get("/metrics", headers=bearer(ACME))
    assert "acme" not in caplog.text and ACME not in caplog.text
    metrics = tenant_client.get("/metrics", headers=bearer(OPERATOR)).text
    assert "acme" not in metrics


def test_public_prefix_files(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    from fake_tokenizer import FakeTokenizer

    tok = FakeTokenizer()
    chat = tmp_path / "system.json"
    chat.write_text('[{"role": "system", "content": "You are the ACME assistant."}]')
    text = tmp_path / "prefix.txt"
    text.write_text("Answer from this manual.\n")
    for path in (chat, text):
        tokens = render_public_prefix(tok, read_public_prefix(str(path)))
        assert tokens
    for content, suffix in (("[]", ".json"), ("{", ".json"), ('[{"role": "wizard"}]', ".json"), ("", ".txt")):
        bad = tmp_path / f"bad{suffix}"
        bad.write_text(content)
        with pytest.raises(PublicPrefixError) as exc:
            read_public_prefix(str(bad))
        assert str(bad) in str(exc.value)


def test_reset_scope(tenant_client: TestClient, engine: FakeEngine) -> None:
    r = tenant_client.post("/reset_prefix_cache?scope=global", headers=bearer(ACME))
    assert_error(r, 403, code="permission_denied")
    assert tenant_client.post("/reset_prefix_cache?scope=tenant", headers=bearer(ACME)).status_code == 200
    assert_error(
        tenant_client.post("/reset_prefix_cache?scope=tenant", headers=bearer(OPERATOR)), 400, "scope"
    )
    assert_error(tenant_client.post("/reset_prefix_cache?scope=all", headers=bearer(OPERATOR)), 400, "scope")
    r = tenant_client.post("/reset_prefix_cache?scope=global", headers=bearer(OPERATOR))
    assert r.json() == {"reset": True}
    gateway = make_client(engine, salt_header="x-tenant")
    r = gateway.post("/reset_prefix_cache?scope=global", headers={**bearer(OPERATOR), "x-tenant": "t"})
    assert_error(r, 403, code="permission_denied")


class _DriftingTokenizer:
    """A template that puts a counter before the messages (like a date) or, once a user message follows,
    something before the system message."""

    def __init__(self, mode: str) -> None:
        from fake_tokenizer import FakeTokenizer

        self.inner = FakeTokenizer()
        self.mode = mode
        self.calls = 0
        self.eos_token_ids = self.inner.eos_token_ids

    def encode(self, text: str, **kw: object) -> list[int]:
        return self.inner.encode(text)

    def decode(self, ids: list[int]) -> str:
        return self.inner.decode(ids)

    def apply_chat_template(self, messages: list[dict], **kw: object) -> str:
        self.calls += 1
        text = self.inner.apply_chat_template(messages, **kw)  # type: ignore[arg-type]
        if self.mode == "variable":
            return f"call {self.calls}\n" + text
        return ("preamble\n" if len(messages) > 1 else "") + text


@pytest.mark.parametrize(
    ("mode", "says"), [("variable", "differently each time"), ("insert", "not share it")]
)
def test_template_drift_is_logged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, mode: str, says: str
) -> None:
    path = tmp_path / "system.json"
    path.write_text('[{"role": "system", "content": "You are the ACME assistant."}]')
    caplog.set_level(logging.WARNING, logger="brine.serve")
    render_public_prefix(_DriftingTokenizer(mode), read_public_prefix(str(path)))  # type: ignore[arg-type]
    assert says in caplog.text and str(path) in caplog.text
    caplog.clear()
    from fake_tokenizer import FakeTokenizer

    render_public_prefix(FakeTokenizer(), read_public_prefix(str(path)))
    assert caplog.text == ""


def test_reset_scope_is_published(tenant_client: TestClient) -> None:
    schema = tenant_client.get("/openapi.json", headers=bearer(ACME)).json()
    params = schema["paths"]["/reset_prefix_cache"]["post"]["parameters"]
    (scope,) = [p for p in params if p["name"] == "scope"]
    assert scope["in"] == "query" and scope["schema"]["enum"] == ["tenant", "global"]
