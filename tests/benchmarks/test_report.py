"""report.ratios / markdown: the headline ratios issue 8 asks for, from known per-request numbers."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is not an installed package

from benchmarks.report import markdown, ratios, summarize  # noqa: E402
from benchmarks.results import RequestResult, WorkloadResult  # noqa: E402


def result(workload: str, server: str, ttfts: dict[str, list[float]], duration: float = 10.0,
           cached: dict[str, int] | None = None) -> WorkloadResult:  # fmt: skip
    reqs = [
        RequestResult(tag, "g", None, ok=True, ttft=t, e2e=t + 1, prompt_tokens=100,
                      cached_tokens=None if cached is None else cached.get(tag, 0), completion_tokens=4)
        for tag, ts in ttfts.items()
        for t in ts
    ]  # fmt: skip
    return WorkloadResult(workload, server, {}, 1, duration, reqs)


def run(server: str, scale: float, duration: float, cached: dict[str, int] | None) -> list[WorkloadResult]:
    return [
        result("doc-qa", server, {"cold": [2.0], "warm": [0.1 * scale, 0.3 * scale]}, cached=cached),
        result("tenants", server, {"cold": [1.0, 1.0], "warm": [0.25 * scale] * 4}, cached=cached),
        result("prefix-repetition", server, {"shared": [0.5] * 8}, duration, cached),
        result("unique", server, {"unique": [0.5] * 5}, duration * 2, cached),
        result("isolation", server, {"cold": [2.0], "warm": [0.2 * scale], "other-tenant": [2.2]},
               cached=cached),
    ]  # fmt: skip


@pytest.fixture
def summaries() -> list[dict]:
    results = [
        *run("brine", 1.0, 4.0, {"warm": 90}),
        *run("brine-no-cache", 10.0, 8.0, {}),
        *run("llama-cpp-python 0.3", 2.0, 16.0, None),  # reports no cached tokens
    ]
    return [summarize(r) for r in results]


def test_ratios_per_server(summaries: list[dict]) -> None:
    rows = {r["server"]: r for r in ratios(summaries)}
    assert list(rows) == ["brine", "brine-no-cache", "llama-cpp-python 0.3"]
    b, off, llama = rows["brine"], rows["brine-no-cache"], rows["llama-cpp-python 0.3"]
    assert b["doc_qa_warm_over_cold_ttft"] == pytest.approx(0.1)  # mean(0.1, 0.3) / 2.0
    assert b["tenants_later_over_first_ttft"] == pytest.approx(0.25)
    assert b["prefix_repetition_req_s"] == pytest.approx(8 / 4.0)
    assert b["prefix_repetition_on_over_off"] == pytest.approx((8 / 4.0) / (8 / 8.0))
    assert b["unique_on_over_off"] == pytest.approx((5 / 8.0) / (5 / 16.0))
    assert b["isolation_b_cached_tokens"] == 0
    assert b["isolation_b_over_a_cold_ttft"] == pytest.approx(1.1)
    assert off["doc_qa_warm_over_cold_ttft"] == pytest.approx(1.0)
    assert off["prefix_repetition_on_over_off"] is None  # it is the "off" side itself
    assert llama["tenants_later_over_first_ttft"] == pytest.approx(0.5)
    assert llama["unique_req_s"] == pytest.approx(5 / 32.0)
    assert llama["unique_on_over_off"] is None  # no caching-off twin in the run
    assert llama["isolation_b_cached_tokens"] is None  # not reported: n/a, never 0


def test_markdown_shows_the_ratio_table(summaries: list[dict]) -> None:
    md = markdown(summaries, "# header")
    assert "| brine | 0.1 | 0.25 | 2 req/s, 2x | 0.625 req/s, 2x | 0 | 1.1x |" in md
    assert "| llama-cpp-python 0.3 | 0.2 | 0.5 | 0.5 req/s | 0.156 req/s | n/a | 1.1x |" in md
    assert md.index("warm / cold") < md.index("| workload | server |")  # the headline comes first


def test_missing_workloads_give_na(summaries: list[dict]) -> None:
    only_docqa = [s for s in summaries if s["workload"] == "doc-qa"]
    (row, *_) = ratios(only_docqa)
    assert row["doc_qa_warm_over_cold_ttft"] == pytest.approx(0.1)
    assert row["tenants_later_over_first_ttft"] is None and row["unique_on_over_off"] is None
