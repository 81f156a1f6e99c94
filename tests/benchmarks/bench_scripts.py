"""Runs a script of benchmarks/ as a user would, for the smoke tests of the native-kernel benchmarks."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def run_native_bench(script: str, *args: str, timeout: float = 300) -> str:
    """`benchmarks/<script> args...`'s stdout (a failed run fails the test); skips where Brine's CPU kernels
    are not available."""
    from engine.model.kernels.build import load

    if load()[0] is None:
        pytest.skip(f"the native kernels are not available here: {load()[1]}")
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / script), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=True,
    ).stdout
