"""benchmarks/kv_dtype_bench.py runs end to end on the default model and reports every measure for both caches
(numbers unchecked: speed is never asserted in tests)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_kv_dtype_bench_reports_each_measure_for_both_caches() -> None:
    from engine.errors import ModelNotFoundError
    from engine.model.kernels.build import load
    from engine.model.loading.files import resolve_model

    if load()[0] is None:
        pytest.skip(f"the native kernels are not available here: {load()[1]}")
    try:
        resolve_model(None)
    except ModelNotFoundError as exc:
        pytest.skip(f"default model not available here: {exc}")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "kv_dtype_bench.py"), "--context", "200", "--rounds", "1"],
        capture_output=True,
        text=True,
        timeout=600,
        check=True,
    ).stdout
    for what in ("warm step", "decode step", "cold prefill"):
        assert re.search(rf"^\| {what} \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", out, re.M), out
