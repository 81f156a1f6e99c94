"""Runs the HTTP server until it is interrupted or the engine dies, and says which with the exit status.

A dead engine (a fault no single request could be blamed for) answers every request with a 503 and `/health`
with a 503 until someone restarts the process. Serving 503s forever helps nobody, so once the engine is dead
the server stops accepting connections, lets the ones in flight finish (each gets its error) for at most
`DRAIN_S`, and the process exits with `EXIT_ENGINE_DEAD`: a supervisor that restarts on failure (systemd's
`Restart=on-failure`, Kubernetes' default `restartPolicy: Always`, compose's `restart: on-failure`) brings
Brine back. An interrupt (Ctrl-C, SIGTERM) exits 0 as before.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Any, Protocol

logger = logging.getLogger("brine.serve")

EXIT_ENGINE_DEAD = 3  # distinct from 1 (could not start) and 2 (bad command line)
DRAIN_S = 5.0  # in-flight responses get this long to end once the engine is dead
POLL_S = 0.25


class HasHealth(Protocol):
    def is_healthy(self) -> bool: ...


class Stoppable(Protocol):
    should_exit: bool

    async def serve(self, sockets: Any = None) -> None: ...


async def serve_until_dead(server: Stoppable, engine: HasHealth, poll_s: float = POLL_S) -> int:
    """Runs `server.serve()`; if the engine dies meanwhile, asks the server to stop (it drains) and returns
    EXIT_ENGINE_DEAD, else 0 once the server stops on its own (an interrupt)."""

    async def watch() -> bool:
        while not server.should_exit:
            if not engine.is_healthy():
                logger.error(
                    "the engine is dead: draining connections (at most %.0f s), then exiting with status %d "
                    "so that a supervisor restarts Brine",
                    DRAIN_S,
                    EXIT_ENGINE_DEAD,
                )
                server.should_exit = True
                return True
            await asyncio.sleep(poll_s)
        return False

    watcher = asyncio.create_task(watch())
    try:
        await server.serve()
    finally:
        if not watcher.done():
            watcher.cancel()
    died = watcher.done() and not watcher.cancelled() and watcher.result()
    return EXIT_ENGINE_DEAD if died else 0


def run(app: Any, engine: HasHealth, *, host: str, port: int, log_level: str, log_config: dict) -> int:
    """uvicorn.run, but returning the exit status `serve_until_dead` chose."""
    import uvicorn

    config = uvicorn.Config(
        app,
        host=host,
        port=port,
        log_level=log_level,
        log_config=log_config,
        timeout_graceful_shutdown=int(DRAIN_S),
    )
    server = uvicorn.Server(config)
    # The loop uvicorn.run would use (uvloop where installed and asked for), without uvicorn's private helper.
    factory = config.get_loop_factory()
    loop = factory() if factory is not None else asyncio.new_event_loop()
    try:
        return loop.run_until_complete(serve_until_dead(server, engine))
    finally:
        loop.close()
