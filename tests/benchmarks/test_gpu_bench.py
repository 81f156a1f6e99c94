"""Smoke run of benchmarks/gpu_bench.py on CPU (`--small`: a tiny random Llama, small workloads): every figure
of the report is measured, through Brine and through transformers, and none is an error."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is not an installed package

from benchmarks import gpu_bench  # noqa: E402


@pytest.mark.timeout(180)
def test_small_run_on_cpu_reports_every_figure(tmp_path: Path):
    try:
        tokenizer = gpu_bench.find_tokenizer(None)
    except SystemExit as exc:
        pytest.skip(str(exc))
    out = tmp_path / "report.json"
    data = gpu_bench.main(["--device", "cpu", "--small", "--tokenizer", str(tokenizer), "--out", str(out)])
    assert json.loads(out.read_text()) == data  # the file holds the final report
    sizes = gpu_bench.Sizes(small=True)
    brine, hf = data["models"]["tiny"]["brine"], data["models"]["tiny"]["transformers"]
    long = f"ttft_{sizes.long_prompt}"
    want = ["ttft_5", f"{long}_cold", f"{long}_warm", *(f"decode_{s}_streams" for s in sizes.streams)]
    for key in [*want, "prefix_repetition_on", "prefix_repetition_off"]:
        assert "error" not in brine[key], (key, brine[key])
    assert all(brine[k]["ms"] > 0 for k in want[:3])
    assert all(brine[f"decode_{s}_streams"]["tok_s"] > 0 for s in sizes.streams)
    assert 0 < brine["decode_1_streams"]["fraction_of_floor"] < 1
    assert brine["prefix_repetition_on_over_off"] > 0
    assert brine["setup"]["cuda_graphs"] == "off"
    for key in [
        "ttft_5",
        f"{long}_cold",
        *(f"decode_{s}_streams" for s in sizes.streams),
        "prefix_repetition",
    ]:
        assert "error" not in hf[key], (key, hf[key])


def test_budget_skips_figures_instead_of_running_them(tmp_path: Path):
    report = gpu_bench.Report(tmp_path / "r.json", budget_s=0.0, meta={})
    report.figure("m", "brine", "x", lambda: pytest.fail("ran past the budget"))
    assert "skipped" in report.data["models"]["m"]["brine"]["x"]
    report = gpu_bench.Report(None, budget_s=None, meta={})
    report.figure("m", "brine", "y", lambda: 1 / 0)
    assert "ZeroDivisionError" in report.data["models"]["m"]["brine"]["y"]["error"]
