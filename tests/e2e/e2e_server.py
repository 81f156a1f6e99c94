"""The e2e server handle and SDK client factory, shared by tests/e2e/conftest.py and the test modules."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

if TYPE_CHECKING:  # imported where used: tests outside e2e import free_port on machines without the SDK
    import openai

ROOT = Path(__file__).resolve().parents[2]
STARTUP_TIMEOUT_S = 600  # the first start converts the GGUF; a busy 2-core machine is slow
API_KEY = "e2e-test-key"
NUM_KV_BLOCKS = 512  # 8192 tokens: plenty for these tests, and far less memory than the 2 GiB default


@dataclass(slots=True)
class BrineServer:
    base_url: str
    api_key: str
    model: str
    log_path: Path

    @property
    def headers(self) -> dict[str, str]:
        return {"Authorization": f"Bearer {self.api_key}"}

    def log_tail(self, chars: int = 4000) -> str:
        return self.log_path.read_text(errors="replace")[-chars:]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def serve_command(port: int) -> list[str]:
    exe = ROOT / ".venv" / "bin" / "brine"
    base = [str(exe)] if exe.exists() else [sys.executable, "-m", "server.cli"]
    return [
        *base, "serve", "--host", "127.0.0.1", "--port", str(port), "--api-key", API_KEY,
        "--num-kv-blocks", str(NUM_KV_BLOCKS), "--max-num-seqs", "8", "--log-level", "info",
    ]  # fmt: skip


@contextmanager
def running_server(log_path: Path, extra_args: tuple[str, ...] = ()) -> Iterator[BrineServer]:
    """`brine serve` on a free loopback port, healthy and with its model id known; stopped on exit."""
    port = free_port()
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("BRINE_API_KEY", None)  # the test decides the keys
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(
            [*serve_command(port), *extra_args], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env
        )
    base = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while True:
            if proc.poll() is not None:
                pytest.fail(f"brine serve exited with {proc.returncode}:\n{log_path.read_text()[-4000:]}")
            try:
                if httpx.get(f"{base}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                pytest.fail(
                    f"brine serve not healthy after {STARTUP_TIMEOUT_S}s:\n{log_path.read_text()[-4000:]}"
                )
            time.sleep(0.5)
        models = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {API_KEY}"}, timeout=10)
        yield BrineServer(base, API_KEY, models.json()["data"][0]["id"], log_path)
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_client(server: BrineServer, *, api_key: str | None = None, strict: bool = True) -> openai.OpenAI:
    import openai

    return openai.OpenAI(
        base_url=f"{server.base_url}/v1",
        api_key=api_key or server.api_key,
        max_retries=0,
        timeout=300,
        _strict_response_validation=strict,
    )


def scrape_metrics(server: BrineServer) -> dict[str, float]:
    """/metrics as {sample name: value}, summed over model_name; request counters keyed `name/reason`."""
    r = httpx.get(f"{server.base_url}/metrics", headers=server.headers, timeout=10)
    assert r.status_code == 200
    out: dict[str, float] = {}
    for family in text_string_to_metric_families(r.text):
        for s in family.samples:
            key = s.name + ("/" + s.labels["finished_reason"] if "finished_reason" in s.labels else "")
            out[key] = out.get(key, 0.0) + s.value
    return out


def wait_for_metrics(server: BrineServer, pred, timeout: float = 30.0) -> dict[str, float]:
    """Scrape until `pred(metrics)` holds or `timeout` passes; returns the last scrape either way."""
    deadline = time.monotonic() + timeout
    while True:
        m = scrape_metrics(server)
        if pred(m) or time.monotonic() > deadline:
            return m
        time.sleep(0.1)


def is_idle(m: dict[str, float], num_blocks: int = NUM_KV_BLOCKS) -> bool:
    """No request runs or waits, and every block in use is one a retention request keeps (cache_control's
    ttl, prompt_cache_retention: pinned on purpose for its TTL, reported as brine_num_retained_blocks)."""
    in_use = round(m["brine_kv_cache_usage_perc"] * num_blocks)
    return (
        in_use == m.get("brine_num_retained_blocks", 0)
        and m["brine_num_requests_running"] == 0
        and m["brine_num_requests_waiting"] == 0
    )
