"""The monitoring kit (docker/monitoring/) against a real Prometheus (Debian's `prometheus` package).

A fresh `brine serve` (its counters start at 0) and a Prometheus scraping it every second with the kit's scrape
config (the API key from a credentials file) and recording rules, on free loopback ports. After the A/B/C
series (tenant A twice, tenant B once, the same document), at the timestamp of Prometheus's last scrape:
- docs/metrics.md's hit-rate query and the hit-rate rule give hits / queries from the server's own counters;
- the TTFT quantile rules give the quantiles of the server's own histogram buckets;
- the throughput rule gives the generated tokens over its window;
- every recorded series matches its expression, and every dashboard expression parses and returns data.
At that timestamp each window starts before the traffic, on samples of 0 (so Prometheus does not extrapolate
to the window's start) and ends on a sample (nor to its end): the values are exact, not approximations.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import subprocess
import time
import uuid
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
import yaml
from e2e_server import ROOT, BrineServer, free_port, make_client, running_server, scrape_metrics
from prometheus_client.parser import text_string_to_metric_families

pytestmark = pytest.mark.slow
KIT = ROOT / "docker" / "monitoring"
PROMETHEUS_YML = KIT / "prometheus" / "prometheus.yml"
RULES_YML = KIT / "prometheus" / "brine.rules.yml"
DASHBOARD = KIT / "grafana" / "dashboards" / "brine.json"
README_HIT_RATE = (
    "increase(brine_prefix_cache_hits_total[5m]) / increase(brine_prefix_cache_queries_total[5m])"
)
WORDS = "river stone garden lamp orbit copper violet engine harbor meadow signal canvas lantern prism".split()


def _require(tool: str) -> str:
    path = shutil.which(tool)
    if path is None:
        pytest.skip(f"`{tool}` is not installed (Debian's prometheus package; .ci/run installs it)")
    return path


def test_promtool_checks_the_kit() -> None:
    promtool = _require("promtool")
    rules = subprocess.run([promtool, "check", "rules", str(RULES_YML)], capture_output=True, text=True)
    assert rules.returncode == 0 and "SUCCESS: 4 rules found" in rules.stdout, rules.stdout + rules.stderr
    # --syntax-only: the credentials file is a path inside the compose stack. The full check (file
    # references included) runs on the test's copy below.
    config = subprocess.run(
        [promtool, "check", "config", "--syntax-only", str(PROMETHEUS_YML)], capture_output=True, text=True
    )
    assert config.returncode == 0, config.stdout + config.stderr


def rules() -> dict[str, str]:
    return {
        r["record"]: r["expr"] for g in yaml.safe_load(RULES_YML.read_text())["groups"] for r in g["rules"]
    }


def dashboard_exprs() -> list[str]:
    panels = json.loads(DASHBOARD.read_text())["panels"]
    # $__rate_interval is Grafana's; at a 1 s scrape it resolves to a minute or less.
    return [t["expr"].replace("$__rate_interval", "1m") for p in panels for t in p["targets"]]


class Prometheus:
    def __init__(self, base: str) -> None:
        self.base = base

    def query(self, expr: str, at: float | None = None) -> list[dict[str, Any]]:
        params = {"query": expr} | ({} if at is None else {"time": f"{at:.3f}"})
        r = httpx.get(f"{self.base}/api/v1/query", params=params, timeout=10)
        assert r.status_code == 200, (expr, r.text)
        body = r.json()
        assert body["status"] == "success", (expr, body)
        return body["data"]["result"]

    def value(self, expr: str, at: float | None = None) -> float:
        result = self.query(expr, at)
        assert len(result) == 1, (expr, result)
        return float(result[0]["value"][1])

    def wait_for(self, expr: str, ok: Any, timeout: float = 60) -> float:
        """Poll an instant query until its single value satisfies `ok`; returns that value."""
        deadline = time.monotonic() + timeout
        while True:
            result = self.query(expr)
            if len(result) == 1 and ok(float(result[0]["value"][1])):
                return float(result[0]["value"][1])
            assert time.monotonic() < deadline, f"{expr}: {result}"
            time.sleep(0.25)


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[BrineServer, Prometheus]]:
    prometheus = _require("prometheus")
    promtool = _require("promtool")
    work = tmp_path_factory.mktemp("prometheus")
    with running_server(work / "serve.log") as server:
        key_file = work / "api_key"
        key_file.write_text(server.api_key)
        config = yaml.safe_load(PROMETHEUS_YML.read_text())
        config["global"] |= {"scrape_interval": "1s", "evaluation_interval": "1s"}
        config["rule_files"] = [str(RULES_YML)]
        [job] = config["scrape_configs"]
        assert job["authorization"] == {"type": "Bearer", "credentials_file": "/keys/api_key"}
        job["authorization"]["credentials_file"] = str(key_file)
        job["static_configs"] = [{"targets": [server.base_url.removeprefix("http://")]}]
        (work / "prometheus.yml").write_text(yaml.safe_dump(config))
        check = subprocess.run(
            [promtool, "check", "config", str(work / "prometheus.yml")], capture_output=True
        )
        assert check.returncode == 0, check.stdout + check.stderr

        port = free_port()
        with open(work / "prometheus.log", "wb") as log:
            proc = subprocess.Popen(
                [prometheus, f"--config.file={work / 'prometheus.yml'}", f"--storage.tsdb.path={work / 'data'}",
                 f"--web.listen-address=127.0.0.1:{port}", "--log.level=warn"],
                stdout=log, stderr=subprocess.STDOUT,
            )  # fmt: skip
        try:
            prom = Prometheus(f"http://127.0.0.1:{port}")
            deadline = time.monotonic() + 60
            while True:
                assert proc.poll() is None, (work / "prometheus.log").read_text()
                try:
                    if httpx.get(f"{prom.base}/-/ready", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
                assert time.monotonic() < deadline, (work / "prometheus.log").read_text()
                time.sleep(0.25)
            yield server, prom
        finally:
            proc.terminate()
            proc.wait(timeout=30)


def document(words: int = 820) -> str:
    rng = random.Random(uuid.uuid4().int)
    return " ".join(rng.choice(WORDS) for _ in range(words))


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus's bucketQuantile over cumulative (upper bound, count) pairs, +Inf last."""
    observations = buckets[-1][1]
    rank = q * observations
    b = next(i for i, (_, count) in enumerate(buckets) if count >= rank)
    if b == len(buckets) - 1:
        return buckets[-2][0]
    start, prev = (0.0, 0.0) if b == 0 else buckets[b - 1]
    end, count = buckets[b]
    return start + (end - start) * (rank - prev) / (count - prev)


def ttft_buckets(server: BrineServer) -> list[tuple[float, float]]:
    r = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=10)
    return sorted(
        (float(s.labels["le"]), s.value)
        for f in text_string_to_metric_families(r.text)
        for s in f.samples
        if s.name == "brine_time_to_first_token_seconds_bucket"
    )


def test_kit_on_a_real_prometheus(stack: tuple[BrineServer, Prometheus]) -> None:
    server, prom = stack
    # Authenticated with the credentials file: up, and the counters seen at 0 before any traffic.
    prom.wait_for('up{job="brine"}', lambda v: v == 1)
    prom.wait_for("brine_prefix_cache_queries_total", lambda v: v == 0)
    assert scrape_metrics(server)["brine_prefix_cache_queries_total"] == 0

    client = make_client(server)
    prefix = "Read this document and answer.\n" + document() + "\n\nQuestion: "
    for salt, question in (("a", "Which word comes first?"), ("a", "Which word is most frequent?"),
                           ("b", "Which word comes first?")):  # fmt: skip
        client.completions.create(model=server.model, prompt=prefix + question, max_tokens=4, temperature=0,
                                  extra_body={"cache_salt": f"tenant-{salt}"})  # fmt: skip

    m = scrape_metrics(server)  # the counters' own values (the server started at 0)
    queries, hits = m["brine_prefix_cache_queries_total"], m["brine_prefix_cache_hits_total"]
    generated = m["brine_generation_tokens_total"]
    assert 0 < hits < queries
    # Wait for a scrape after the traffic; its timestamp is where every query below is evaluated.
    prom.wait_for("brine_generation_tokens_total", lambda v: v == generated)
    prom.wait_for("brine_prefix_cache_queries_total", lambda v: v == queries)
    prom.wait_for("brine_time_to_first_token_seconds_count", lambda v: v == 3)
    at = prom.value("timestamp(brine_prefix_cache_queries_total)")
    assert prom.value("brine_prefix_cache_queries_total", at) == queries

    buckets = ttft_buckets(server)
    expected = {
        "model_name:brine_prefix_cache_hit_rate:ratio_5m": hits / queries,
        "model_name:brine_time_to_first_token_seconds:p50_5m": histogram_quantile(0.5, buckets),
        "model_name:brine_time_to_first_token_seconds:p90_5m": histogram_quantile(0.9, buckets),
        "model_name:brine_generation_tokens:rate_5m": generated / 300,
    }
    assert README_HIT_RATE in (ROOT / "docs" / "metrics.md").read_text()
    assert prom.value(README_HIT_RATE, at) == pytest.approx(hits / queries, rel=1e-9)
    recorded = rules()
    assert set(recorded) == set(expected)
    for name, expr in recorded.items():
        assert prom.value(expr, at) == pytest.approx(expected[name], rel=1e-9), name
        # The rule manager records the same expression: its latest sample (after the traffic) agrees.
        prom.wait_for(f"timestamp({name})", lambda t: t > at + 1)
        when = prom.value(f"timestamp({name})")
        if name.endswith("rate_5m"):
            # A rate moves a little with how far Prometheus extrapolates to the evaluation time.
            assert prom.value(name, when) == pytest.approx(prom.value(expr, when), rel=0.1), name
        else:  # ratios and quantiles do not: the extrapolation scales every term alike
            assert prom.value(name, when) == pytest.approx(expected[name], rel=1e-9), name

    exprs = dashboard_exprs()
    assert len(exprs) >= 14
    for expr in exprs:
        result = prom.query(expr, at)
        assert result, f"no data: {expr}"
        assert all(not math.isnan(float(s["value"][1])) or "quantile" in expr for s in result), expr
