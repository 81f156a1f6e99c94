"""One real `brine serve` (default model, API key on, small KV pool) shared by the e2e modules of a session,
plus OpenAI SDK clients pointed at it with strict response validation.

The server runs as a subprocess on a free loopback port; its log goes to a file that failures print.
"""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from e2e_server import (
    API_KEY,
    ROOT,
    STARTUP_TIMEOUT_S,
    BrineServer,
    free_port,
    is_idle,
    make_client,
    serve_command,
    wait_for_metrics,
)


@pytest.fixture(scope="session")
def brine_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrineServer]:
    port = free_port()
    log_path = tmp_path_factory.mktemp("brine-e2e") / "serve.log"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    env.pop("BRINE_API_KEY", None)  # the test decides the keys
    with open(log_path, "wb") as log:
        proc = subprocess.Popen(serve_command(port), cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env=env)
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


@pytest.fixture(scope="session")
def client(brine_server: BrineServer) -> openai.OpenAI:
    return make_client(brine_server)


@pytest.fixture
def async_client(brine_server: BrineServer) -> openai.AsyncOpenAI:
    # Function-scoped: an AsyncOpenAI's connection pool belongs to the event loop of the test that made it.
    return openai.AsyncOpenAI(
        base_url=f"{brine_server.base_url}/v1",
        api_key=brine_server.api_key,
        max_retries=0,
        timeout=300,
        _strict_response_validation=True,
    )


@pytest.fixture(autouse=True)
def no_block_leaks(request: pytest.FixtureRequest) -> Iterator[None]:
    """After every test that used the server, every KV block must come back (aborts land within a step)."""
    yield
    if "brine_server" not in request.fixturenames:
        return
    server: BrineServer = request.getfixturevalue("brine_server")
    after = wait_for_metrics(server, is_idle)
    assert is_idle(after), (
        f"blocks still held after the test: kv usage {after['brine_kv_cache_usage_perc']}, "
        f"running {after['brine_num_requests_running']}, waiting {after['brine_num_requests_waiting']}"
    )
