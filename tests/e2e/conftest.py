"""One real `brine serve` (default model, API key on, small KV pool) shared by the e2e modules of a session,
plus OpenAI SDK clients pointed at it with strict response validation.

The server runs as a subprocess on a free loopback port; its log goes to a file that failures print.
"""

from __future__ import annotations

from collections.abc import Iterator

import openai
import pytest
from e2e_server import BrineServer, is_idle, make_client, running_server, wait_for_metrics


@pytest.fixture(scope="session")
def brine_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrineServer]:
    with running_server(tmp_path_factory.mktemp("brine-e2e") / "serve.log") as server:
        yield server


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
        f"retained {after.get('brine_num_retained_blocks')}, "
        f"running {after['brine_num_requests_running']}, waiting {after['brine_num_requests_waiting']}"
    )
