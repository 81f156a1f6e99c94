"""What docs/replicas.md says about routing by `prompt_cache_key`, checked against vllm-router itself:
its `consistent_hash` policy does not read the field from a body (requests that share a key but not their
text land on different replicas), and the header recipe (`X-Session-ID` copied from the key) pins a key to one
replica. The replicas are Brine's app over the fake engine (no model is loaded): what is tested is the router.
Marked slow (it starts the router binary), so the quick runs and mutmut leave it out.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import uvicorn
from fake_engine import FakeEngine

from server.app import create_app

pytestmark = pytest.mark.slow

ROUTER = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
KEY = "routing-test-key"
HEADERS = {"Authorization": f"Bearer {KEY}"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _serve(engine: FakeEngine, port: int) -> uvicorn.Server:
    config = uvicorn.Config(
        create_app(engine, api_keys=[KEY]), host="127.0.0.1", port=port, log_level="warning"
    )
    server = uvicorn.Server(config)
    threading.Thread(target=server.run, daemon=True).start()
    deadline = time.monotonic() + 20
    while not server.started:
        if time.monotonic() > deadline:
            raise AssertionError("a fake replica did not start")
        time.sleep(0.05)
    return server


@pytest.fixture(scope="module")
def routed(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, list[FakeEngine]]]:
    if ROUTER is None:
        pytest.skip("vllm-router is not installed (the test extras install it)")
    engines = [FakeEngine(model_name="fake-model") for _ in range(2)]
    ports = [free_port() for _ in engines]
    servers = [_serve(e, p) for e, p in zip(engines, ports, strict=True)]
    router_port = free_port()
    log = tmp_path_factory.mktemp("routing") / "router.log"
    cmd = [ROUTER, "--host", "127.0.0.1", "--port", str(router_port), "--policy", "consistent_hash"]
    cmd += ["--worker-urls", *(f"http://127.0.0.1:{p}" for p in ports), "--api-key", KEY]
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{router_port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/v1/models", headers=HEADERS, timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"vllm-router did not start:\n{log.read_text()[-4000:]}")
            time.sleep(0.3)
        yield url, engines
    finally:
        proc.terminate()
        proc.wait(30)
        for server in servers:
            server.should_exit = True


def _replicas_reached(
    url: str, engines: list[FakeEngine], key: str, header: bool, requests: int = 12
) -> set[int]:
    reached = set()
    for i in range(requests):
        before = [len(e.calls) for e in engines]
        body = {"model": "fake-model", "input": f"question {i} about {key}", "max_output_tokens": 2}
        body["prompt_cache_key"] = key
        headers = {**HEADERS, **({"X-Session-ID": key} if header else {})}
        r = httpx.post(f"{url}/v1/responses", json=body, headers=headers, timeout=30)
        assert r.status_code == 200, r.text
        assert r.json()["prompt_cache_key"] == key
        reached |= {j for j, e in enumerate(engines) if len(e.calls) > before[j]}
    return reached


def test_the_router_ignores_prompt_cache_key_in_the_body(routed: tuple[str, list[FakeEngine]]) -> None:
    url, engines = routed
    # Same key, different texts: hashed by body, so both replicas get some (24 requests: 2 in 2^24 odds of one).
    assert _replicas_reached(url, engines, "tenant-a-docs", header=False, requests=24) == {0, 1}


def test_the_header_recipe_pins_a_key_to_one_replica(routed: tuple[str, list[FakeEngine]]) -> None:
    url, engines = routed
    # The ring is built from the replicas' URLs, whose ports are random, so which replica a fixed key lands on
    # changes from run to run (six fixed keys all landed on one replica in 1 run of 32). So keys are tried
    # until both replicas have been used, and every key tried must stay on its one replica: at least six keys,
    # at most 30 (one replica taking all 30 is 2 in 2^30).
    used: set[int] = set()
    for k in range(30):
        reached = _replicas_reached(url, engines, f"key-{k}", header=True)
        assert len(reached) == 1, f"key-{k} reached replicas {sorted(reached)}"
        used |= reached
        if k >= 5 and used == {0, 1}:
            break
    assert used == {0, 1}
