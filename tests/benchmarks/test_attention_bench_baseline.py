"""`benchmarks/attention_bench.py --baseline`: another checkout's kernels, built and bound beside this tree's."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from engine.model.attention.base import AttentionMetadata
from engine.model.attention.native import NativeBackend
from engine.model.kernels.build import CSRC, build_baseline, load

ROOT = Path(__file__).resolve().parents[2]


def test_a_baseline_built_from_these_sources_gives_the_same_bits(tmp_path: Path) -> None:
    kernels, why = load()
    if kernels is None:
        pytest.skip(f"native kernels unavailable: {why}")
    before = NativeBackend(build_baseline(CSRC, tmp_path / "baseline.so"))
    after = NativeBackend(kernels)
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(12, 16, 3, 64, generator=g).bfloat16()
    vc = torch.randn(12, 16, 3, 64, generator=g).bfloat16()
    meta = AttentionMetadata(
        [5, 1], [37, 90], [[3, 1, 7], [2, 4, 5, 6, 8, 9]], 16, torch.zeros(0, dtype=torch.int64)
    )
    q = torch.randn(6, 9, 64, generator=g).bfloat16()
    outs = [b.forward(q, q, q, kc, vc, b.plan(meta), None, 0.125) for b in (before, after)]
    assert torch.equal(outs[0].view(torch.int16), outs[1].view(torch.int16))
    assert outs[1].abs().sum() > 0


def test_a_baseline_without_sources_is_refused(tmp_path: Path) -> None:
    with pytest.raises((OSError, subprocess.CalledProcessError)):
        build_baseline(tmp_path, tmp_path / "baseline.so")


@pytest.mark.parametrize("kv", [[], ["--kv-float16"]], ids=["cache-in-query-dtype", "float16-cache"])
def test_the_bench_compares_this_tree_with_itself(tmp_path: Path, kv: list[str]) -> None:
    """Every decode case (short, long, in DRAM) on both kernels, over the query dtype's cache or (`--kv-float16`)
    float32 queries over a float16 one: the same bits."""
    if load()[0] is None:
        pytest.skip("native kernels unavailable")
    out = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "attention_bench.py"), "--baseline", str(ROOT), "--repeats", "1",
         "--cases", "decode", *kv],
        capture_output=True, text=True, timeout=600, cwd=ROOT,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-2000:]
    from benchmarks.attention_bench import CASES

    rows = [line for line in out.stdout.splitlines() if line.startswith(tuple(CASES))]
    decodes = [name for name in CASES if "decode" in name]
    assert len(rows) == len(decodes) == 4 and all(row.split()[-1] == "yes" for row in rows), out.stdout
    assert ("float32" in out.stdout.splitlines()[0]) == bool(kv), out.stdout
