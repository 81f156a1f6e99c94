"""`benchmarks/last_layer_bench.py`: the stack's last layer for the logits rows only against it for every row."""

from __future__ import annotations

import pytest
from bench_scripts import run_native_bench


@pytest.mark.slow
def test_the_bench_runs_a_prompt_both_ways_with_the_same_bits() -> None:
    from engine.errors import ModelNotFoundError
    from engine.model.loading.files import resolve_model

    try:
        resolve_model(None)
    except ModelNotFoundError as exc:
        pytest.skip(f"default model not available here: {exc}")
    out = run_native_bench("last_layer_bench.py", "--lengths", "40,17", "--repeats", "2", "--threads", "1")
    rows = [line.split() for line in out.splitlines() if line.strip()[:1].isdigit()]
    assert [r[0] for r in rows] == ["40", "17"], out
    for r in rows:
        kept, every = float(r[1]), float(r[2])
        assert kept > 0 and every > 0 and r[-1] == "yes", out
