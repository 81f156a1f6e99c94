"""benchmarks/quiet.py: a server's turn waits for idle CPUs, but never longer than its cap."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks import quiet  # noqa: E402


def _machine(busy_windows: int, monkeypatch) -> list[int]:  # noqa: ANN001
    """/proc/stat's totals for a 2-CPU machine whose CPUs are both busy for `busy_windows` reads, then idle;
    the reads are counted in the returned list."""
    reads: list[int] = []
    state = {"total": 1000, "idle": 500}

    def times() -> tuple[int, int]:
        n = len(reads)
        reads.append(n)
        if n:  # 50 ticks of 2 CPUs per window: all busy, then all idle
            state["total"] += 50
            state["idle"] += 0 if n <= busy_windows else 50
        return state["total"], state["idle"]

    monkeypatch.setattr(quiet, "_cpu_times", times)
    return reads


def test_it_waits_out_the_busy_windows_then_returns(monkeypatch) -> None:  # noqa: ANN001
    reads = _machine(3, monkeypatch)
    waited = asyncio.run(quiet.wait_quiet(window_s=0.01, max_wait_s=5.0))
    assert len(reads) == 1 + 3 + 1  # the baseline, three busy windows, the idle one
    assert 0.04 <= waited < 1.0


def test_a_machine_that_never_goes_quiet_costs_the_cap_only(monkeypatch) -> None:  # noqa: ANN001
    reads = _machine(10**6, monkeypatch)
    waited = asyncio.run(quiet.wait_quiet(window_s=0.01, max_wait_s=0.1))
    assert 0.1 <= waited < 1.0 and 5 < len(reads) < 100


def test_no_cap_is_no_wait_and_reads_nothing(monkeypatch) -> None:  # noqa: ANN001
    reads = _machine(10**6, monkeypatch)
    assert asyncio.run(quiet.wait_quiet(max_wait_s=0)) == 0.0 and reads == []


def test_the_real_proc_stat_parses_where_there_is_one() -> None:
    times = quiet._cpu_times()
    if times is None:
        return  # not Linux: wait_quiet sleeps instead
    total, idle = times
    assert 0 <= idle <= total and total > 0
