"""`benchmarks/quant_linear_bench.py`: this tree's quantized linears against a baseline checkout's, built beside."""

from __future__ import annotations

from bench_scripts import ROOT, run_native_bench


def test_the_bench_compares_this_tree_with_itself() -> None:
    """Against its own sources every row count gives the same bits, and the table has a row per count."""
    out = run_native_bench(
        "quant_linear_bench.py", "--baseline", str(ROOT), "--rows", "33,1", "--rounds", "1", "--threads", "1"
    )
    rows = [line for line in out.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [line.split("|")[1].strip() for line in rows] == ["33", "1"], out
    assert all(line.rstrip().endswith("| yes |") for line in rows), out
