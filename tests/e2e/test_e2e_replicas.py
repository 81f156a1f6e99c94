"""Two real `brine serve` replicas behind `vllm-router --policy kv_aware`, routed by Brine's own KV events.

Slow tier: two model loads plus the router (installed from PyPI by the test extras). API keys are on at both
hops: the router's own calls (render, KV discovery) authenticate with its `--api-key`, an operator key.

The hit-ratio workload is unsalted: vllm-router 0.1.17's kv_aware gives a request with a cache_salt no prefix
credit at all (its log: `outcome="cache_salt"`), whatever the events say, so salted traffic would measure the
router's choice, not Brine's events (benchmarks/replicas_bench.py measures both).
"""

from __future__ import annotations

import concurrent.futures as cf
import re
import shutil
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from tests.e2e.e2e_server import API_KEY, BrineServer, free_port, running_server, scrape_metrics

pytestmark = pytest.mark.slow

ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
BLOCK_SIZE = 16
HEADERS = {"Authorization": f"Bearer {API_KEY}"}
# 3 documents of ~850 tokens, 4 questions each, in waves of one question per document (all 3 in flight).
DOCS = [" ".join(f"doc{d} word{i} alpha beta" for i in range(120)) for d in range(3)]
WAVES = 4


@dataclass(slots=True)
class Cluster:
    replicas: list[BrineServer]
    router_url: str
    router_log: Path


def _free_pair() -> int:
    """A free port whose successor is free too (the replay socket binds PORT + 1)."""
    for _ in range(50):
        port = free_port()
        try:
            with __import__("socket").socket() as s:
                s.bind(("127.0.0.1", port + 1))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair")


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    if ROUTER is None:
        pytest.skip("vllm-router is not installed (pip install vllm-router; the test extras install it)")
    tmp = tmp_path_factory.mktemp("replicas")
    with ExitStack() as stack:
        replicas, events = [], []
        for i in range(2):
            port = _free_pair()
            events.append(port)
            # 192 blocks: one replica holds all 3 documents (162 blocks), so the ceiling is the full one.
            args = ("--num-kv-blocks", "192", "--kv-events-endpoint", f"tcp://127.0.0.1:{port}")
            replicas.append(stack.enter_context(running_server(tmp / f"replica{i}.log", args)))
        router_port = free_port()
        cmd = [ROUTER, "--host", "127.0.0.1", "--port", str(router_port), "--policy", "kv_aware"]
        cmd += ["--worker-urls", *(r.base_url for r in replicas), "--api-key", API_KEY]
        cmd += ["--kv-event-model", replicas[0].model, "--kv-event-block-size", str(BLOCK_SIZE)]
        for r, port in zip(replicas, events, strict=True):
            cmd += ["--kv-event-source", f"{r.base_url}=tcp://127.0.0.1:{port}"]
            cmd += ["--kv-event-replay-source", f"{r.base_url}=tcp://127.0.0.1:{port + 1}"]
        router_log = tmp / "router.log"
        with open(router_log, "wb") as log:
            proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        stack.callback(proc.wait, 30)
        stack.callback(proc.terminate)
        url = f"http://127.0.0.1:{router_port}"
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/v1/models", headers=HEADERS, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vllm-router did not start:\n{router_log.read_text()[-4000:]}")
            time.sleep(0.5)
        yield Cluster(replicas, url, router_log)


def _plain_log(path: Path) -> str:
    return re.sub(r"\x1b\[[0-9;]*m", "", path.read_text(errors="replace"))


def _ask(base: str, doc: int, question: int) -> tuple[int, int]:
    body = {"prompt": f"{DOCS[doc]} Question {question}: what?", "max_tokens": 1}
    r = httpx.post(f"{base}/v1/completions", headers=HEADERS, json=body, timeout=300)
    assert r.status_code == 200, r.text
    usage = r.json()["usage"]
    return usage["prompt_tokens"], (usage.get("prompt_tokens_details") or {}).get("cached_tokens", 0)


def _workload(base: str) -> float:
    """Cached / prompt tokens over the waves; each wave has every document in flight at once."""
    prompt = cached = 0
    with cf.ThreadPoolExecutor(len(DOCS)) as pool:
        for q in range(WAVES):
            for p, c in pool.map(lambda d, q=q: _ask(base, d, q), range(len(DOCS))):
                prompt, cached = prompt + p, cached + c
    return cached / prompt


def _served(server: BrineServer) -> float:
    m = scrape_metrics(server)
    return sum(v for k, v in m.items() if k.startswith("brine_request_success_total"))


def _reset(cluster: Cluster) -> None:
    for r in cluster.replicas:
        assert httpx.post(f"{r.base_url}/reset_prefix_cache", headers=HEADERS, timeout=30).status_code == 200


def test_router_subscribed_to_both_replicas_events(cluster: Cluster) -> None:
    log = _plain_log(cluster.router_log)
    for r in cluster.replicas:
        assert f"kv_index {r.base_url}: spawned subscriber rank0" in log, log[-3000:]


def test_kv_aware_reaches_the_single_replica_ceiling_on_both_replicas(cluster: Cluster) -> None:
    _reset(cluster)
    ceiling = _workload(cluster.replicas[0].base_url)  # one replica, no router
    _reset(cluster)
    before = [_served(r) for r in cluster.replicas]
    ratio = _workload(cluster.router_url)
    served = [_served(r) - b for r, b in zip(cluster.replicas, before, strict=True)]
    assert all(n > 0 for n in served), f"one replica got everything: {served}"
    assert ceiling > 0.5
    assert ratio >= 0.97 * ceiling, f"hit ratio {ratio:.3f} through the router, ceiling {ceiling:.3f}"
    # The router's own reason for each pick: a prefix credit computed from Brine's events. Events carry whole
    # blocks only, so the router cannot steer for the few tokens a replica reuses inside a block (a tail):
    # through it, the hit ratio may fall short of one replica's by those (0.7466 against 0.7467 in one run).
    assert 'outcome="prefix_cost"' in _plain_log(cluster.router_log) or ratio >= 0.99 * ceiling


def test_invalid_salt_comes_back_as_brines_400(cluster: Cluster) -> None:
    body = {"messages": [{"role": "user", "content": "hi"}], "cache_salt": "", "max_tokens": 1}
    r = httpx.post(f"{cluster.router_url}/v1/chat/completions", headers=HEADERS, json=body, timeout=60)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "cache_salt"


def test_no_route_the_router_calls_answers_404(cluster: Cluster) -> None:
    for r in cluster.replicas:
        log = r.log_path.read_text(errors="replace")
        called = re.findall(r'"(?:GET|POST) (\S+) HTTP/1.1" (\d+)', log)
        assert called, "no access log lines"
        missing = sorted({path for path, status in called if status == "404"})
        assert not missing, f"{r.base_url} answered 404 to {missing}"
        assert any(path == "/v1/completions/render" for path, _ in called)  # kv_aware renders every prompt
