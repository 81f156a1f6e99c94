"""benchmarks/kv_dtype_bench.py runs end to end on the default model and reports every measure for both caches
(numbers unchecked: speed is never asserted in tests)."""

from __future__ import annotations

import re

import pytest
from bench_scripts import run_native_bench


@pytest.mark.slow
def test_kv_dtype_bench_reports_each_measure_for_both_caches() -> None:
    from engine.errors import ModelNotFoundError
    from engine.model.loading.files import resolve_model

    try:
        resolve_model(None)
    except ModelNotFoundError as exc:
        pytest.skip(f"default model not available here: {exc}")
    out = run_native_bench("kv_dtype_bench.py", "--context", "200", "--rounds", "1", timeout=600)
    for what in ("warm step", "decode step", "cold prefill"):
        assert re.search(rf"^\| {what} \| [\d.]+ \| [\d.]+ \| [\d.]+x \|$", out, re.M), out
