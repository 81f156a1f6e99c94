"""How many CPU threads torch computes with (`brine serve --threads N`).

On a 2-core machine a busy neighbour process oversubscribes the cores, and torch's default (one thread per
core) then collapses: an OpenMP team waits at every op's barrier for a thread the OS has parked. `--threads`
caps the team. It is applied at engine start, before the model loads (the batch-invariance probes measure the
matmuls with the threads they will run with), and again on the step thread, which runs every op.

torch is imported only when a count is given: an engine over a fake runner never needs it.

One thread computes, and only one (`on_fresh_thread`): libgomp keeps a pool of OpenMP worker threads for each
thread that has ever started a parallel region, alive until that thread exits. Once the pools hold more
threads than there are cores, libgomp stops letting idle workers spin between regions, and every op of a
step then pays a sleep and a wake-up. Loading the model on the main thread and stepping on the engine
thread made two pools: measured on the project's 2-core EPYC, a default-model decode step took ~33 ms on
the engine thread against ~16 ms when the same thread had loaded the model.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


def on_fresh_thread(fn: Callable[[], T], threads: int | None = None) -> T:
    """fn()'s result (or its exception), computed on a new thread that has exited when this returns, with
    torch's intra-op threads set there first (see set_torch_threads). Its OpenMP pool exits with it, so the
    thread that steps the engine is left the only one with a pool (see the module docstring)."""
    result: list[T] = []
    error: list[BaseException] = []

    def run() -> None:
        try:
            set_torch_threads(threads)
            result.append(fn())
        except BaseException as exc:  # handed to the caller below
            error.append(exc)

    thread = threading.Thread(target=run, name="brine-load")
    thread.start()
    thread.join()
    if error:
        raise error[0]
    return result[0]


def set_torch_threads(threads: int | None) -> int | None:
    """Make torch compute with `threads` intra-op threads (None: torch's default, left alone). Returns the
    count now in force on the calling thread, or None when nothing was asked. ValueError below 1.

    The inter-op pool (torch.jit.fork and friends) gets one thread: the engine never runs ops side by side,
    and an idle pool of N more threads only competes for the cores. torch allows that setting once per
    process, before any parallel work; later calls (a second engine in one process) keep the first one."""
    if threads is None:
        return None
    if threads < 1:
        raise ValueError(f"threads must be at least 1, got {threads}")
    import torch

    torch.set_num_threads(threads)
    try:
        torch.set_num_interop_threads(1)
    except RuntimeError:  # already set, or parallel work has started: keep what is there
        pass
    return torch.get_num_threads()


def default_torch_threads() -> int:
    """The intra-op thread count torch uses when not told (one per core it can run on)."""
    import torch

    return torch.get_num_threads()
