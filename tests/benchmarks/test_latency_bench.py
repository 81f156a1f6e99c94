"""The latency benchmark (issue 29's targets) against fake servers: what it sends, what it measures, what the
report says about the targets; and its place in compare.py's report."""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from test_bench_smoke import fake_app, serve

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is not an installed package

from benchmarks import compare  # noqa: E402
from benchmarks.latency_bench import LatencyResult, markdown, measure, ratios  # noqa: E402


@pytest.fixture
def two_fakes() -> Iterator[tuple[str, object, str, object]]:
    brine_app, llama_app = fake_app(), fake_app()
    for brine_url in serve(brine_app):
        for llama_url in serve(llama_app):
            yield brine_url, brine_app, llama_url, llama_app


def test_measure_sends_each_kind_and_times_it(two_fakes) -> None:  # noqa: ANN001
    brine_url, brine_app, llama_url, llama_app = two_fakes
    results = asyncio.run(
        measure({"brine": brine_url, "llama": llama_url}, llama="llama", eos_token_ids=[2], repeats=3,
                long_tokens=60, decode_tokens=8, quiet_s=0)
    )  # fmt: skip
    for r in results:
        assert not r.errors
        assert len(r.ttft_short) == len(r.ttft_warm) == len(r.decode_tok_s) == 3
        assert len(r.ttft_cold_long) == 3
        assert all(t > 0 for t in r.ttft_short + r.ttft_warm + r.ttft_cold_long)
        assert all(0 < x < 1000 for x in r.decode_tok_s)  # the fake streams a token per 20 ms
    for app, is_llama in ((brine_app, False), (llama_app, True)):
        bodies = app.state.bodies
        assert all(b["stream"] and b["temperature"] == 0.0 for b in bodies)
        long = [b for b in bodies if len(b["prompt"].split()) > 20]
        # one cold send, then 3 warm, then 2 other documents once each (the cold TTFT's median of 3)
        assert len(long) == 6 and len({b["prompt"] for b in long[:4]}) == 1
        assert len({b["prompt"] for b in long}) == 3 and all(b["max_tokens"] == 1 for b in long)
        # each starts with its own id, so that none shares a block with another
        assert len({b["prompt"].split(")")[0] for b in long}) == 3
        short = [b for b in bodies if b["max_tokens"] == 1 and b not in long]
        assert len({b["prompt"] for b in short}) == 3  # a new prompt each time: nothing cached
        decode = [b for b in bodies if b["max_tokens"] == 8]
        assert len(decode) == 3
        if is_llama:  # no ignore_eos in llama-cpp-python: its EOS is banned instead
            assert all(b["logit_bias"] == {"2": -100.0} and "ignore_eos" not in b for b in decode)
        else:
            assert all(b["ignore_eos"] is True and "logit_bias" not in b for b in decode)


def test_a_stream_that_ends_early_is_an_error_not_a_rate() -> None:
    app = fake_app(cut_after=3)
    for url in serve(app):
        (r,) = asyncio.run(measure({"brine": url}, repeats=1, long_tokens=30, decode_tokens=8, quiet_s=0))
    assert r.decode_tok_s == [] and any("ended after" in e for e in r.errors)


def result(name: str, short: float, warm: float, tok_s: float) -> LatencyResult:
    return LatencyResult(
        name, ttft_short=[short], ttft_cold_long=[1.0], ttft_warm=[warm], decode_tok_s=[tok_s]
    )


def test_ratios_and_targets_in_the_report() -> None:
    both = [result("brine", 0.050, 0.100, 15.0), result("llama", 0.010, 0.010, 30.0)]
    r = ratios(both, "brine", "llama")
    assert r["ttft_short"] == pytest.approx(5.0) and r["ttft_warm"] == pytest.approx(10.0)
    assert r["decode_tok_s"] == pytest.approx(0.5) and r["brine_warm_over_short"] == pytest.approx(2.0)
    md = markdown(both, "brine", "llama")
    assert "| 5-token TTFT | 5.00x | <= 1.5x | **not met** |" in md
    assert "| warm TTFT | 10.00x | <= 2x | **not met** |" in md
    assert "| decode tok/s | 0.50x | >= 1x | **not met** |" in md
    assert "| brine's warm TTFT / its 5-token TTFT | 2.00x | <= 1.5x | **not met** |" in md
    good = markdown(
        [result("brine", 0.010, 0.012, 60.0), result("llama", 0.010, 0.010, 30.0)], "brine", "llama"
    )
    assert good.count("| met |") == 4 and "not met" not in good


def test_vllm_peer_gets_its_own_targets() -> None:
    # Brine 50 ms short / 100 ms warm / 1 s cold; vLLM 40 ms / 250 ms / 2 s: 1.25x (not met), 0.4x, 0.5x (met).
    vllm = LatencyResult(
        "vllm", ttft_short=[0.040], ttft_cold_long=[2.0], ttft_warm=[0.250], decode_tok_s=[10.0]
    )
    runs = [result("brine", 0.050, 0.100, 15.0), result("llama", 0.010, 0.010, 30.0), vllm]
    r = ratios(runs, "brine", "llama", "vllm")
    assert r["vllm_ttft_short"] == pytest.approx(1.25) and r["vllm_ttft_warm"] == pytest.approx(0.4)
    assert r["vllm_ttft_cold_long"] == pytest.approx(0.5) and r["ttft_short"] == pytest.approx(5.0)
    md = markdown(runs, "brine", "llama", "vllm")
    assert "| brine / vllm | measured | target | |" in md
    assert "| 5-token TTFT | 1.25x | <= 1x | **not met** |" in md
    assert "| warm TTFT | 0.40x | <= 0.5x | met |" in md
    assert "| cold TTFT (~2k tokens) | 0.50x | <= 0.7x | met |" in md
    assert "vllm_ttft_short" not in ratios(runs, "brine", "llama")  # no vLLM named: no vLLM ratios


def test_brine_only_mode() -> None:
    md = markdown([result("brine", 0.050, 0.060, 15.0)], "brine", None)
    assert "| 5-token TTFT | n/a | <= 1.5x |  |" in md
    assert "| brine's warm TTFT / its 5-token TTFT | 1.20x | <= 1.5x | met |" in md
    assert "No llama-cpp-python server ran" in md


def test_compare_opens_its_report_with_the_latency_targets(two_fakes, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    brine_url, _, llama_url, llama_app = two_fakes
    monkeypatch.setattr(compare, "default_eos_token_ids", lambda: [2])
    md_path = compare.main(["--external", f"brine={brine_url}", "--external", f"llama-cpp-python={llama_url}",
                            "--workloads", "latency,unique", "--preset", "tiny", "--out-dir", str(tmp_path),
                            "--name", "lat", "--quiet-wait", "0"])  # fmt: skip
    md = md_path.read_text()
    assert md.index("## Single-request latency") < md.index("| unique | brine |")
    assert "| brine / llama-cpp-python | measured | target | |" in md
    data = json.loads((tmp_path / "lat.json").read_text())
    assert {r["server"] for r in data["latency"]["results"]} == {"brine", "llama-cpp-python"}
    assert data["latency"]["ratios"]["ttft_short"] > 0
    assert any("logit_bias" in b for b in llama_app.state.bodies)


def test_compare_reports_vllm_as_a_peer_in_latency_and_throughput(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    brine_app, vllm_app = fake_app(), fake_app()
    monkeypatch.setattr(compare, "default_eos_token_ids", lambda: [2])
    for brine_url in serve(brine_app):
        for vllm_url in serve(vllm_app):
            md_path = compare.main(["--external", f"brine={brine_url}", "--external", f"vllm-cpu={vllm_url}",
                                    "--workloads", "latency,unique", "--preset", "tiny",
                                    "--out-dir", str(tmp_path), "--name", "peer", "--quiet-wait", "0"])  # fmt: skip
    md = md_path.read_text()
    assert "| brine / vllm-cpu | measured | target | |" in md  # the latency targets against vLLM
    assert "| cold TTFT (~2k tokens) |" in md
    row = next(line for line in md.splitlines() if line.startswith("| unique | ") and ">= 1.2x" in line)
    brine_rate, vllm_rate, ratio = (cell.strip() for cell in row.split("|")[2:5])
    assert float(ratio.rstrip("x")) == pytest.approx(float(brine_rate) / float(vllm_rate), rel=0.02)
    data = json.loads((tmp_path / "peer.json").read_text())
    assert data["latency"]["ratios"]["vllm_ttft_short"] > 0
    # vLLM ran no ignore_eos-less decode: it takes ignore_eos as Brine does (only llama-cpp-python is banned EOS)
    assert all("logit_bias" not in b for b in vllm_app.state.bodies)


def test_compare_says_why_vllm_did_not_run(monkeypatch, tmp_path) -> None:  # noqa: ANN001
    monkeypatch.setattr(compare, "VLLM_PYTHON", tmp_path / "missing" / "python")
    note = compare.vllm_spec(2)
    assert isinstance(note, str) and note.startswith("vllm skipped:") and "make bench-vllm" in note


def test_each_servers_turn_waits_for_quiet_cpus_first(two_fakes, monkeypatch) -> None:  # noqa: ANN001
    """Servers share the cores: a server timed right after vLLM CPU lost a core to its worker
    (benchmarks/quiet.py), so every server's turn at every measure starts with a wait for idle CPUs, capped by `quiet_s`."""
    import benchmarks.latency_bench as lb

    brine_url, brine_app, llama_url, _ = two_fakes
    waits: list[tuple[float, int]] = []

    async def wait_quiet(max_wait_s: float) -> float:
        waits.append((max_wait_s, len(brine_app.state.bodies)))
        return 0.0

    monkeypatch.setattr(lb, "wait_quiet", wait_quiet)
    asyncio.run(measure({"brine": brine_url, "llama": llama_url}, repeats=1, long_tokens=30, decode_tokens=8,
                        quiet_s=3.0))  # fmt: skip
    assert [w for w, _ in waits] == [3.0] * 8  # warm, cold, short, decode: each on both servers
    sent = [n for _, n in waits]
    assert sent[0] == 0 and sent == sorted(sent) and len(set(sent)) > 1  # before brine's first send, and on


def test_compare_says_it_waited_for_quiet_cpus(two_fakes, tmp_path) -> None:  # noqa: ANN001
    brine_url, _, llama_url, _ = two_fakes
    for wait, said in (("0.3", True), ("0", False)):
        md = compare.main(["--external", f"brine={brine_url}", "--external", f"other={llama_url}",
                           "--workloads", "unique", "--preset", "tiny", "--out-dir", str(tmp_path),
                           "--name", f"quiet-{wait}", "--quiet-wait", wait]).read_text()  # fmt: skip
        assert ("began once the CPUs were >= 90% idle" in md) is said
        assert f"or after {wait} s (benchmarks/quiet.py)" in md or not said
