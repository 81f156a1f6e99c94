"""End to end: the real `brine serve` with the default model; `/metrics` must agree with what requests saw.

The sequence: tenant A sends a ~1000-token prefix + question, then the same prefix + another question, then
tenant B (another cache_salt) sends A's first prompt. After each request we scrape `/metrics` (parsed with
prometheus_client's parser, as a scraper would) and check the exact deltas: queries grow by the request's
prompt tokens; hits grow by its `usage.prompt_tokens_details.cached_tokens`, which is 0 for A's first request
and for B, and > 0 for A's second. Uses the session's shared server (tests/e2e/conftest.py): counters are
compared as deltas, taken while no other request is in flight.
"""

from __future__ import annotations

import random
import time
import uuid

import httpx
import openai
import pytest
from e2e_server import BrineServer
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow

WORDS = ("river stone garden lamp orbit copper violet engine harbor meadow signal canvas lantern prism "
         "thunder willow beacon falcon glacier marble ember quartz saddle timber velvet anchor cobalt dune "
         "feather granite jasmine kettle ledger mosaic nectar oyster pepper quiver raven spindle tulip "
         "umber vessel walnut yonder zephyr amber basalt cedar delta").split()  # fmt: skip
Metrics = dict[tuple[str, frozenset[tuple[str, str]]], float]
DELTAS = ("brine_prefix_cache_queries_total", "brine_prefix_cache_hits_total", "brine_generation_tokens_total",
          "brine_prompt_tokens_total", "brine_request_success_total", "brine_time_to_first_token_seconds_count",
          "brine_request_prompt_tokens_sum")  # fmt: skip


def scrape(server: BrineServer) -> Metrics:
    r = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=10)
    assert r.status_code == 200, r.text
    assert r.headers["content-type"].startswith("text/plain")
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(r.text)
        for s in family.samples
    }


def total(metrics: Metrics, name: str) -> float:
    """Sum over every series of a sample name (one model_name; all finish reasons)."""
    return sum(v for (n, _), v in metrics.items() if n == name)


def scrape_when_idle(server: BrineServer, min_finished: float = 0.0) -> Metrics:
    """Scrape once nothing runs or waits and at least `min_finished` requests have finished: the engine
    records a step's stats right after the step, and an earlier test may have left an abort in flight."""
    deadline = time.monotonic() + 30
    while True:
        m = scrape(server)
        idle = total(m, "brine_num_requests_running") == 0 and total(m, "brine_num_requests_waiting") == 0
        if idle and total(m, "brine_request_success_total") >= min_finished:
            return m
        assert time.monotonic() < deadline, "the server did not go idle"
        time.sleep(0.05)


def document(words: int = 820) -> str:
    rng = random.Random(uuid.uuid4().int)  # a prefix no earlier test can have cached
    return " ".join(rng.choice(WORDS) for _ in range(words))


def test_prefix_cache_counters_match_usage(client: openai.OpenAI, brine_server: BrineServer) -> None:
    salt_a, salt_b = f"tenant-a-{uuid.uuid4().hex}", f"tenant-b-{uuid.uuid4().hex}"
    prefix = "Read this document and answer.\n" + document() + "\n\nQuestion: "
    steps = [
        (salt_a, prefix + "Which word comes first?"),
        (salt_a, prefix + "Which word is the most frequent?"),
        (salt_b, prefix + "Which word comes first?"),  # A's exact first prompt, under B's salt
    ]
    before = scrape_when_idle(brine_server)
    seen: list[tuple[int, int]] = []
    for salt, prompt in steps:
        r = client.completions.create(model=brine_server.model, prompt=prompt, max_tokens=4, temperature=0,
                                      extra_body={"cache_salt": salt})  # fmt: skip
        usage = r.usage
        assert usage is not None and usage.prompt_tokens_details is not None
        cached = usage.prompt_tokens_details.cached_tokens or 0
        after = scrape_when_idle(brine_server, total(before, "brine_request_success_total") + 1)
        d = {name: total(after, name) - total(before, name) for name in DELTAS}
        assert d["brine_prefix_cache_queries_total"] == usage.prompt_tokens, (salt, usage, d)
        assert d["brine_prefix_cache_hits_total"] == cached, (salt, usage, d)
        assert d["brine_request_success_total"] == 1
        assert d["brine_time_to_first_token_seconds_count"] == 1
        assert d["brine_request_prompt_tokens_sum"] == usage.prompt_tokens
        assert d["brine_generation_tokens_total"] == usage.completion_tokens
        # Prompt tokens the model computed: the prompt minus what the cache served (no preemption here).
        assert d["brine_prompt_tokens_total"] == usage.prompt_tokens - cached
        seen.append((usage.prompt_tokens, cached))
        before = after

    (a1_tokens, a1_cached), (_, a2_cached), (_, b_cached) = seen
    assert 800 <= a1_tokens <= 1600  # the ~1000-token prefix really is that long
    assert a1_cached == 0  # cold: nobody used this salt before
    # Warm: every full block of the shared prefix, short of the few tokens at the join with the question.
    assert a2_cached >= a1_tokens - 64
    assert b_cached == 0  # another salt never reads A's blocks

    text = httpx.get(f"{brine_server.base_url}/metrics", headers=brine_server.headers, timeout=10).text
    assert salt_a not in text and salt_b not in text  # nothing tenant-specific in labels


def test_reset_prefix_cache_does_not_reset_counters(client: openai.OpenAI, brine_server: BrineServer) -> None:
    prompt = document(40) + " " + document(40)  # a couple of full blocks, so there is something to lose
    client.completions.create(model=brine_server.model, prompt=prompt, max_tokens=1)
    client.completions.create(model=brine_server.model, prompt=prompt, max_tokens=1)
    before = scrape_when_idle(brine_server)
    assert total(before, "brine_prefix_cache_hits_total") > 0
    r = httpx.post(f"{brine_server.base_url}/reset_prefix_cache", headers=brine_server.headers, timeout=30)
    assert r.status_code == 200, r.text
    after = scrape(brine_server)
    for name in ("brine_prefix_cache_queries_total", "brine_prefix_cache_hits_total"):
        assert total(after, name) == total(before, name)
    assert 0.0 <= total(after, "brine_kv_cache_usage_perc") <= 1.0


def test_live_exposition_is_the_documented_exporter(brine_server: BrineServer) -> None:
    """The server exports exactly the exporter's metric families (no extra collector, none missing), so the
    docs/metrics.md check against the exporter (tests/metrics/test_readme_metrics.py) covers what a scraper sees."""
    from metrics.prometheus import PrometheusStatLogger

    r = httpx.get(f"{brine_server.base_url}/metrics", headers=brine_server.headers, timeout=10)
    assert r.status_code == 200, r.text
    live = {(f.name, f.type) for f in text_string_to_metric_families(r.text)}
    body, _ = PrometheusStatLogger("any").render()
    assert live == {(f.name, f.type) for f in text_string_to_metric_families(body.decode())}
    labels = {k for f in text_string_to_metric_families(r.text) for s in f.samples for k in s.labels}
    # Every label names something the operator declared or a fixed set, never a tenant or a salt: the tier that
    # served a hit, a draft position, the operator's LoRA adapter names (vLLM's lora_requests_info labels).
    allowed = {"model_name", "finished_reason", "kind", "le", "tier", "position"}
    allowed |= {"lora_name", "max_lora", "running_lora_adapters", "waiting_lora_adapters"}
    assert labels <= allowed
