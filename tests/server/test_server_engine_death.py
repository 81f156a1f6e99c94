"""When the engine dies the process does not serve 503s forever: `/health` says so, the server drains and
`server.supervise.run` returns EXIT_ENGINE_DEAD (the status `brine serve` exits with), for a supervisor to
restart it. An interrupt still returns 0."""

from __future__ import annotations

import time

import httpx
from fake_engine import FakeEngine
from server_helpers import MODEL
from server_thread import start_server

from server import supervise


def test_a_dead_engine_makes_the_server_exit_non_zero() -> None:
    engine = FakeEngine(model_name=MODEL)
    thread, status, url = start_server(engine)
    engine.healthy = False  # what AsyncEngine's step thread does on a fault no request can be blamed for
    thread.join(timeout=supervise.DRAIN_S + 10)
    assert not thread.is_alive()
    assert status == [supervise.EXIT_ENGINE_DEAD] and supervise.EXIT_ENGINE_DEAD != 0
    try:
        httpx.get(f"{url}/health", timeout=1)
        raise AssertionError("the server still listens after the engine died")
    except httpx.TransportError:
        pass


def test_health_is_503_while_dead_until_the_watcher_stops_the_server() -> None:
    engine = FakeEngine(model_name=MODEL)
    thread, status, url = start_server(engine)
    engine.healthy = False
    seen = []
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and not seen:
        try:
            seen.append(httpx.get(f"{url}/health", timeout=1).status_code)
        except httpx.TransportError:
            break  # already stopped: fine, the other test covers the exit
    thread.join(timeout=supervise.DRAIN_S + 10)
    assert status == [supervise.EXIT_ENGINE_DEAD]
    assert all(code == 503 for code in seen)


async def test_an_interrupted_server_with_a_healthy_engine_returns_zero() -> None:
    class Server:
        should_exit = False

        async def serve(self, sockets=None) -> None:
            self.should_exit = True  # what uvicorn does on SIGINT / SIGTERM

    assert await supervise.serve_until_dead(Server(), FakeEngine(model_name=MODEL), poll_s=0.01) == 0
