"""Tenancy end to end, on the real default model: tenants from API keys, a shared ~600-token public system
prompt, tenant-scoped resets, 403s on the operator's routes, --require-cache-salt, the gateway header, a
malformed tenants file, and the three-series /metrics check with tenants instead of body salts.

Two servers of this module's own (module-scoped; different flags from the session's shared one):
- `tenants`: --api-key (the operator), --tenants (three tenants), --public-prefix system.json,
  --require-cache-salt;
- `gateway`: --salt-header x-tenant-id.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import openai
import pytest
from e2e_server import ROOT, STARTUP_TIMEOUT_S, BrineServer, free_port, is_idle, make_client, wait_for_metrics
from prometheus_client.parser import text_string_to_metric_families

from server.tenants import key_hash

pytestmark = pytest.mark.slow

OPERATOR = "e2e-operator-key"
TENANTS = {name: f"sk-{name}-{uuid.uuid4().hex}" for name in ("tenant-a7", "tenant-b7", "tenant-c7")}
A, B, C = TENANTS.values()
BLOCK = 16
WORDS = ("river stone garden lamp orbit copper violet engine harbor meadow signal canvas lantern prism "
         "thunder willow beacon falcon glacier marble ember quartz saddle timber velvet anchor").split()  # fmt: skip
# ~600 tokens of public system prompt (fixed text: it is published, so every run may use the same).
SYSTEM = "You are the support assistant of the Brine test shop. " + " ".join(
    random.Random(13).choice(WORDS) for _ in range(580)
)


def _text(words: int) -> str:
    rng = random.Random(uuid.uuid4().int)  # nothing an earlier test can have cached
    return " ".join(rng.choice(WORDS) for _ in range(words))


@contextmanager
def _start(tmp: Path, name: str, args: list[str]) -> Iterator[BrineServer]:
    port = free_port()
    log_path = tmp / f"{name}.log"
    exe = ROOT / ".venv" / "bin" / "brine"
    base = [str(exe)] if exe.exists() else ["python", "-m", "server.cli"]
    cmd = [*base, "serve", "--host", "127.0.0.1", "--port", str(port), "--num-kv-blocks", "512",
           "--max-num-seqs", "8", "--log-level", "info", *args]  # fmt: skip
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("BRINE_API_KEY", None)
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"brine serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.5)
        yield BrineServer(url, OPERATOR, "smollm2-135m-instruct", log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def tenants_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrineServer]:
    tmp = tmp_path_factory.mktemp("tenancy")
    lines = ["# e2e tenants", ""] + [f"{name} {key_hash(key)}" for name, key in TENANTS.items()]
    (tmp / "tenants.txt").write_text("\n".join(lines) + "\n")
    (tmp / "system.json").write_text(json.dumps([{"role": "system", "content": SYSTEM}]))
    args = ["--api-key", OPERATOR, "--tenants", str(tmp / "tenants.txt"), "--public-prefix",
            str(tmp / "system.json"), "--require-cache-salt"]  # fmt: skip
    with _start(tmp, "tenants", args) as server:
        yield server
        check_no_tenant_in_log(server.log_path)


@pytest.fixture(scope="module")
def gateway_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrineServer]:
    with _start(tmp_path_factory.mktemp("gateway"), "gateway", ["--salt-header", "x-tenant-id"]) as server:
        yield server


def check_no_tenant_in_log(log_path: Path) -> None:
    text = log_path.read_text(errors="replace")
    for name, key in TENANTS.items():
        assert name not in text and key not in text, "the log names a tenant or its key"


def client_for(server: BrineServer, key: str) -> openai.OpenAI:
    return make_client(server, api_key=key)


def public_full_tokens(server: BrineServer) -> int:
    """The public prefix's full blocks, in tokens: what any tenant's request starting with it may share."""
    body = {"messages": [{"role": "system", "content": SYSTEM}], "add_generation_prompt": False}
    r = httpx.post(
        f"{server.base_url}/tokenize", json=body, headers={"Authorization": f"Bearer {A}"}, timeout=30
    )
    assert r.status_code == 200, r.text
    count = r.json()["count"]
    assert 500 <= count <= 800  # the ~600-token system prompt
    return count // BLOCK * BLOCK


def chat_cached(client: openai.OpenAI, question: str, salt: str | None = None) -> tuple[int, int]:
    extra = {"cache_salt": salt} if salt else {}
    r = client.chat.completions.create(
        model="smollm2-135m-instruct",
        messages=[{"role": "system", "content": SYSTEM}, {"role": "user", "content": question}],
        max_tokens=2,
        temperature=0,
        extra_body=extra,
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens or 0


def completion_cached(client: openai.OpenAI, prompt: str, salt: str | None = None) -> tuple[int, int]:
    extra = {"cache_salt": salt} if salt else {}
    r = client.completions.create(
        model="smollm2-135m-instruct", prompt=prompt, max_tokens=2, temperature=0, extra_body=extra
    )
    assert r.usage is not None and r.usage.prompt_tokens_details is not None
    return r.usage.prompt_tokens, r.usage.prompt_tokens_details.cached_tokens or 0


def idle(server: BrineServer) -> None:
    assert is_idle(wait_for_metrics(server, is_idle)), "the server did not go idle"


def test_two_tenants_never_share_with_the_same_or_no_salt(tenants_server: BrineServer) -> None:
    a, b = client_for(tenants_server, A), client_for(tenants_server, B)
    prompt = "Read this list.\n" + _text(150) + "\nWhich word is first?"
    for salt in ("same-salt", None):
        tokens, first = completion_cached(a, prompt, salt)
        assert tokens > 150 and first == 0
        _, again = completion_cached(a, prompt, salt)
        assert again >= tokens - BLOCK  # A reads its own blocks
        _, other = completion_cached(b, prompt, salt)
        assert other == 0  # B never reads A's, whatever salt both send
    idle(tenants_server)


def test_public_system_prompt_is_shared_exactly(tenants_server: BrineServer) -> None:
    public = public_full_tokens(tenants_server)
    a, b = client_for(tenants_server, A), client_for(tenants_server, B)
    question = "Which word is first? " + _text(8)
    tokens, a_first = chat_cached(a, question)
    assert a_first in (0, public)  # cold, or the public prefix an earlier test cached
    _, a_again = chat_cached(a, question)
    assert a_again == tokens  # A's own blocks too, then its tail and its kept logits: every token
    # B sends A's exact full prompt: exactly the public prefix's full blocks, never one block more.
    _, b_same = chat_cached(b, question)
    assert b_same == public
    _, b_salted = chat_cached(b, "Another question? " + _text(8), salt="end-user-1")
    assert b_salted == public
    idle(tenants_server)


def test_operator_routes_stay_the_operators(tenants_server: BrineServer) -> None:
    url = tenants_server.base_url
    for key in (A, B):
        h = {"Authorization": f"Bearer {key}"}
        r = httpx.get(f"{url}/metrics", headers=h, timeout=10)
        assert r.status_code == 403 and r.json()["error"]["code"] == "permission_denied"
        assert httpx.post(f"{url}/reset_prefix_cache?scope=global", headers=h, timeout=30).status_code == 403
        assert httpx.get(f"{url}/v1/models", headers=h, timeout=10).status_code == 200
        assert (
            httpx.post(f"{url}/detokenize", json={"tokens": [1, 2]}, headers=h, timeout=10).status_code == 200
        )
    assert (
        httpx.get(f"{url}/metrics", headers={"Authorization": "Bearer nope"}, timeout=10).status_code == 401
    )
    metrics = httpx.get(f"{url}/metrics", headers=tenants_server.headers, timeout=10)
    assert metrics.status_code == 200
    assert not any(name in metrics.text for name in TENANTS)


def test_require_cache_salt(tenants_server: BrineServer) -> None:
    operator = client_for(tenants_server, OPERATOR)
    with pytest.raises(openai.BadRequestError) as exc:
        completion_cached(operator, "Hello there")
    assert exc.value.param == "cache_salt" and exc.value.code == "missing_cache_salt"
    assert completion_cached(operator, "Hello there", salt="ops")[0] > 0
    assert completion_cached(client_for(tenants_server, C), "Hello there")[0] > 0  # a tenant is a namespace


def test_tenant_reset_forgets_only_its_own_blocks(tenants_server: BrineServer) -> None:
    public = public_full_tokens(tenants_server)
    a, b, c = (client_for(tenants_server, k) for k in (A, B, C))
    question = "What is the last word? " + _text(30)
    tokens, _ = chat_cached(a, question)
    chat_cached(b, question)
    own = tokens  # each tenant's own blocks, then its own tail and kept logits (engine.kept_logits): every token
    assert chat_cached(a, question)[1] == own and chat_cached(b, question)[1] == own
    idle(tenants_server)
    r = httpx.post(f"{tenants_server.base_url}/reset_prefix_cache", headers={"Authorization": f"Bearer {A}"},
                   timeout=30)  # fmt: skip
    assert r.status_code == 200, r.text
    forgotten = r.json()["forgotten_blocks"]
    assert forgotten >= (own // BLOCK * BLOCK - public) // BLOCK  # at least this prompt's private blocks
    assert chat_cached(a, question)[1] == public  # nothing beyond the public prefix
    assert chat_cached(b, question)[1] == own  # B's blocks are untouched
    assert chat_cached(c, question)[1] == public  # and so is the public prefix
    idle(tenants_server)


def scrape(server: BrineServer) -> dict[str, float]:
    r = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=10)
    assert r.status_code == 200
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def scrape_when_idle(server: BrineServer, min_finished: float = 0.0) -> dict[str, float]:
    deadline = time.monotonic() + 30
    while True:
        m = scrape(server)
        if is_idle(m) and m["brine_request_success_total"] >= min_finished:
            return m
        assert time.monotonic() < deadline, "the server did not go idle"
        time.sleep(0.05)


@pytest.mark.parametrize("route", ["chat-with-public-prefix", "completions"])
def test_three_series_metrics_deltas_with_tenants(tenants_server: BrineServer, route: str) -> None:
    """Tenant A cold, A warm, then B with A's first prompt: /metrics deltas match each request's usage; A's
    second request hits its cached tokens; B hits nothing but the public prefix (when one is declared)."""
    public = public_full_tokens(tenants_server) if route != "completions" else 0
    doc = _text(700)
    a, b = client_for(tenants_server, A), client_for(tenants_server, B)
    # Chat: behind the public system prompt; completions: a plain prompt, no public prefix.
    steps = [(a, doc + "\nWhich word comes first?"), (a, doc + "\nWhich word is the most frequent?"),
             (b, doc + "\nWhich word comes first?")]  # fmt: skip
    names = ("brine_prefix_cache_queries_total", "brine_prefix_cache_hits_total",
             "brine_prefix_cache_public_hits_total", "brine_prompt_tokens_total", "brine_request_success_total")  # fmt: skip
    before = scrape_when_idle(tenants_server)
    seen = []
    for client, text in steps:
        tokens, cached = (completion_cached if route == "completions" else chat_cached)(client, text)
        after = scrape_when_idle(tenants_server, before["brine_request_success_total"] + 1)
        d = {n: after[n] - before[n] for n in names}
        assert d["brine_prefix_cache_queries_total"] == tokens
        assert d["brine_prefix_cache_hits_total"] == cached
        assert d["brine_prompt_tokens_total"] == tokens - cached
        assert d["brine_request_success_total"] == 1
        # Public hits: the public prefix's full blocks, whenever they were served from the cache.
        assert d["brine_prefix_cache_public_hits_total"] == min(cached, public)
        seen.append((tokens, cached))
        before = after
    (a1_tokens, a1), (_, a2), (_, b1) = seen
    assert a1_tokens > 700
    # Cold but for the public prefix, if an earlier test cached it, and a tail of fewer than a block: the
    # leading tokens of the next block that this tenant's own earlier chats sent too (the rest of the system
    # prompt, the user turn's header), reused token by token.
    assert a1 == 0 or public <= a1 < public + BLOCK
    assert a2 >= a1_tokens - 64 and a2 > public  # warm: its own document's blocks
    # Another tenant: the public prefix, and at most such a tail of its own; never A's document.
    assert (b1 == 0 and public == 0) or public <= b1 < public + BLOCK
    text = httpx.get(f"{tenants_server.base_url}/metrics", headers=tenants_server.headers, timeout=10).text
    assert not any(name in text for name in TENANTS)


def test_gateway_header_mode(gateway_server: BrineServer) -> None:
    url = gateway_server.base_url
    prompt = "Read this list.\n" + _text(120) + "\nWhich word is first?"

    def cached(team: str | None, salt: str | None = None) -> int | httpx.Response:
        headers = {"x-tenant-id": team} if team else {}
        body = {"prompt": prompt, "max_tokens": 2, "temperature": 0}
        if salt:
            body["cache_salt"] = salt
        r = httpx.post(f"{url}/v1/completions", json=body, headers=headers, timeout=120)
        if r.status_code != 200:
            return r
        return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]

    assert cached("team-1") == 0
    assert isinstance(cached("team-1"), int) and cached("team-1") > 0
    assert cached("team-2") == 0  # another gateway tenant, the same prompt
    assert cached("team-1", salt="user-9") == 0  # the body salt partitions inside the header's namespace
    missing = cached(None)
    assert isinstance(missing, httpx.Response) and missing.status_code == 400
    assert missing.json()["error"]["param"] == "x-tenant-id"
    idle(gateway_server)


def test_malformed_tenants_file_refuses_to_start(tmp_path: Path) -> None:
    bad = tmp_path / "tenants.txt"
    bad.write_text(f"# ok\nacme {key_hash('k')}\n\nglobex not-a-sha256\n")
    exe = ROOT / ".venv" / "bin" / "brine"
    base = [str(exe)] if exe.exists() else ["python", "-m", "server.cli"]
    r = subprocess.run([*base, "serve", "--port", str(free_port()), "--tenants", str(bad)],
                       cwd=ROOT, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 1
    assert "line 4" in r.stderr + r.stdout
    assert "loading" not in r.stderr  # refused before the model load
