"""The express lane's driver side: what the engine does at a pause in a step, and how often it may.

A main step of many rows (64 decodes: ~50 ms on two cores; a long prefill: seconds) pauses between two decoder
layers (`ForwardContext.between_layers`); there the engine core takes the requests that arrived meanwhile
(`Interjection.poll`), runs an express pass of short requests (engine.scheduler: a new owner's first chunk,
the decodes of owners running only a few sequences) as a step of its own, and hands its outputs to their
callers at once (`Interjection.emit`), then lets the main step go on. Batch invariance makes this free of
side effects on tokens: every row's bits are those of any other schedule.

`ExpressPacer` keeps express passes to about half of the time while they keep coming (a pass may start once
as long has passed since the last one ended as that one took): a small owner's tokens come at about twice
its idle pace, and a flood keeps at least half of the machine.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from engine.outputs import RequestOutput


class Interjection(Protocol):
    """What the engine's driver (AsyncEngine's step thread) does for the core at a pause in a step."""

    def poll(self) -> None:
        """Adds the requests that arrived since the step began (aborts wait for its end: the step in flight
        may be writing the blocks an abort would free)."""
        ...

    def emit(self, outputs: list[RequestOutput]) -> None:
        """Hands outputs to their callers now."""
        ...


class ExpressPacer:
    """Whether an express pass may start now: not before as long has passed since the last one ended as that
    one took."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._next = 0.0

    def due(self) -> bool:
        return self._clock() >= self._next

    @contextmanager
    def timing(self) -> Iterator[None]:
        """Times one express pass."""
        start = self._clock()
        try:
            yield
        finally:
            end = self._clock()
            self._next = end + (end - start)
