"""A real server for the tests that need one (a socket, uvicorn, the supervisor): `server.supervise.run` in a
thread over a fake engine, on a free port."""

from __future__ import annotations

import socket
import threading
import time

import httpx
from fake_engine import FakeEngine
from fastapi import FastAPI

from server import supervise
from server.app import create_app
from server.serve import log_config


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_server(engine: FakeEngine, app: FastAPI | None = None) -> tuple[threading.Thread, list[int], str]:
    """`server.supervise.run` over `app` (create_app(engine) by default) in a thread, on a free port; returns
    once /health answers. It stops when `engine.healthy` turns False."""
    port = _free_port()
    status: list[int] = []
    app = app or create_app(engine)

    def main() -> None:
        status.append(
            supervise.run(
                app, engine, host="127.0.0.1", port=port, log_level="warning", log_config=log_config()
            )
        )

    thread = threading.Thread(target=main, daemon=True)
    thread.start()
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return thread, status, url
        except httpx.TransportError:
            time.sleep(0.05)
    raise AssertionError("the server did not start")
