"""benchmarks/attention_bench.py runs end to end and reports both backends for every case (numbers unchecked:
speed is never asserted in tests)."""

from __future__ import annotations

import re

from bench_scripts import run_native_bench


def test_attention_bench_reports_every_case_for_both_backends() -> None:
    out = run_native_bench("attention_bench.py", "--repeats", "1", "--threads", "1")
    rows = [ln for ln in out.splitlines() if re.search(r"\d+\.\d{3} +\d+\.\d{3} +\d+\.\d\dx$", ln)]
    from benchmarks.attention_bench import CASES

    assert [r.split("  ")[0].strip() for r in rows] == list(CASES), out
    assert "decode, 2,000 in DRAM" in CASES  # the case a warm TTFT's attention is


def test_attention_bench_kv_float16_reports_the_same_bits_over_a_float16_cache() -> None:
    """`--kv-float16`: the native kernel over a float32 cache and over a float16 one holding the same numbers,
    case by case, and their outputs must have the same bits (`--kv-cache-dtype float16`'s contract)."""
    out = run_native_bench(
        "attention_bench.py", "--kv-float16", "--repeats", "1", "--cases", "decode, 2,000", "--threads", "1"
    )
    assert "float32 KV" in out and "float16 KV" in out, out
    rows = [ln for ln in out.splitlines() if ln.startswith("decode, 2,000")]
    assert len(rows) == 2 and all(r.endswith(" yes") for r in rows), out
