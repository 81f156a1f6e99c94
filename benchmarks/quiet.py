"""Waiting for the machine to go quiet before a server's turn in a run that times several servers.

Why: the servers of one run share the machine's cores, and a server can keep working after its last answer.
vLLM CPU's worker keeps a core busy for ~1 s after each request (measured on a 2-core VM: ~97 of 100 clock
ticks in the second after a cold prompt, none in the next); whichever server was timed right after it lost
that core, and its cold TTFT read ~8% slower than on an idle machine. Each server's turn now starts once the
CPUs have been idle, so no server pays for the one before it.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

_STAT = Path("/proc/stat")


def _cpu_times() -> tuple[int, int] | None:
    """(all jiffies, idle + iowait jiffies) summed over the CPUs, or None where /proc/stat is missing."""
    try:
        fields = _STAT.read_text().split("\n", 1)[0].split()
    except OSError:
        return None
    ticks = [int(v) for v in fields[1:]]
    return sum(ticks), ticks[3] + (ticks[4] if len(ticks) > 4 else 0)


async def wait_quiet(idle: float = 0.9, window_s: float = 0.25, max_wait_s: float = 5.0) -> float:
    """Returns once the CPUs were at least `idle` idle over a `window_s` window, or after `max_wait_s` (a machine
    that is never quiet must not stall the run); the seconds waited. Without /proc/stat: one second's sleep
    (capped likewise). `max_wait_s` <= 0: no wait (tests, whose fake servers share the process)."""
    start = time.monotonic()
    if max_wait_s <= 0:
        return 0.0
    before = _cpu_times()
    if before is None:
        await asyncio.sleep(min(1.0, max_wait_s))
        return time.monotonic() - start
    while True:
        await asyncio.sleep(window_s)
        now = _cpu_times()
        assert now is not None
        total, idle_ticks = now[0] - before[0], now[1] - before[1]
        waited = time.monotonic() - start
        if (total > 0 and idle_ticks / total >= idle) or waited >= max_wait_s:
            return waited
        before = now
