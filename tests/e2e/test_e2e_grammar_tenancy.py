"""Compiled grammars per cache namespace, through a real `brine serve`: the same schema compiles once per
namespace (never a cache hit for another salt, so its answer time cannot tell that another tenant sent it),
a reset forgets it; and a grammar whose mask grows past the per-token budget fails its own request (a 400
that names the budget) while a request beside it is answered and the server stays healthy; a compile over --grammar-compile-timeout is a 400
naming the field that carried the schema."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator

import httpx
import pytest
from e2e_server import BrineServer, running_server
from prometheus_client.parser import text_string_to_metric_families

MSG = [{"role": "user", "content": "Name a customer."}]


def _compiles(server: BrineServer) -> float:
    r = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=10)
    return next(
        s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
        if s.name == "brine_grammar_compile_seconds_count"
    )


def _ask(server: BrineServer, schema: dict, salt: str) -> None:
    body = {
        "model": server.model,
        "messages": MSG,
        "max_tokens": 4,
        "temperature": 0,
        "cache_salt": salt,
        "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
    }
    r = httpx.post(f"{server.base_url}/v1/chat/completions", json=body, headers=server.headers, timeout=300)
    assert r.status_code == 200, r.text


def test_the_same_schema_compiles_once_per_namespace(brine_server: BrineServer) -> None:
    secret = uuid.uuid4().hex  # a schema no other test sent
    schema = {"type": "object", "properties": {"customer": {"enum": [f"acme-{secret}", "globex"]}}}
    a, b = f"tenant-a-{secret}", f"tenant-b-{secret}"
    start = _compiles(brine_server)
    _ask(brine_server, schema, a)
    _ask(brine_server, schema, a)
    assert _compiles(brine_server) == start + 1  # one namespace: compiled once, then a hit
    _ask(brine_server, schema, b)
    assert _compiles(brine_server) == start + 2  # another namespace never hits the first one's grammar
    r = httpx.post(f"{brine_server.base_url}/reset_prefix_cache", headers=brine_server.headers, timeout=60)
    assert r.status_code == 200, r.text
    _ask(brine_server, schema, a)
    assert _compiles(brine_server) == start + 3  # forgotten with the prefix cache


async def test_a_grammar_over_the_mask_budget_fails_alone(brine_server: BrineServer) -> None:
    # Ambiguous: every run of letters parses in exponentially many ways, and xgrammar's mask cost grows with
    # the output (past the 10 ms default budget within ~30 tokens on a 2-core EPYC).
    ambiguous = 'root ::= (s)*\ns ::= s s | "a" | [a-z]+'
    headers = brine_server.headers
    async with httpx.AsyncClient(base_url=brine_server.base_url, headers=headers, timeout=300) as http:
        slow = http.post(
            "/v1/completions",
            json={
                "model": brine_server.model,
                "prompt": "letters:",
                "max_tokens": 400,
                "min_tokens": 400,
                "temperature": 0,
                "guided_grammar": ambiguous,
            },
        )
        innocent = http.post(
            "/v1/completions",
            json={"model": brine_server.model, "prompt": "Hello", "max_tokens": 16, "temperature": 0},
        )
        slow_r, innocent_r = await asyncio.gather(slow, innocent)
        assert innocent_r.status_code == 200, innocent_r.text
        # Failed on its own, never 400 tokens of it, and told why: its grammar, named by its field.
        assert slow_r.status_code == 400, slow_r.text[:300]
        err = slow_r.json()["error"]
        assert err["code"] == "grammar_mask_budget_exceeded" and err["param"] == "guided_grammar"
        assert "per-token mask budget" in err["message"]
        health = await http.get("/health")
        assert health.status_code == 200
        again = await http.post(
            "/v1/completions",
            json={"model": brine_server.model, "prompt": "Hello", "max_tokens": 4, "temperature": 0},
        )
        assert again.status_code == 200
        assert json.loads(again.text)["choices"][0]["finish_reason"] == "length"


@pytest.fixture(scope="module")
def quick_timeout_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrineServer]:
    log = tmp_path_factory.mktemp("brine-grammar-timeout") / "serve.log"
    with running_server(
        log, ("--grammar-compile-timeout", "0.5", "--grammar-compile-workers", "1")
    ) as server:
        yield server


def test_a_compile_over_the_timeout_is_a_400_naming_the_field(quick_timeout_server: BrineServer) -> None:
    server = quick_timeout_server
    # ~2 s of compiling on a 2-core EPYC (a 60,000-value enum), well past the 0.5 s timeout.
    huge = {"type": "string", "enum": [f"customer-{i}" for i in range(60000)]}
    body = {"model": server.model, "messages": MSG, "max_tokens": 4, "guided_json": huge}
    url = f"{server.base_url}/v1/chat/completions"
    r = httpx.post(url, json=body, headers=server.headers, timeout=300)
    assert r.status_code == 400, r.text[:300]
    err = r.json()["error"]
    assert err["param"] == "guided_json" and "longer than 0.5 s to compile" in err["message"]
    # The killed worker's replacement compiles the next schema.
    small = {"model": server.model, "messages": MSG, "max_tokens": 4, "guided_json": {"enum": ["a", "b"]}}
    ok = httpx.post(url, json=small, headers=server.headers, timeout=300)
    assert ok.status_code == 200, ok.text
