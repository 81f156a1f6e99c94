"""PrometheusStatLogger: feed known steps, parse render() with prometheus_client's parser, check exact values."""

from __future__ import annotations

import subprocess
import sys
import threading
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kv_cache.stats import PrefixCacheStats
from metrics.prometheus import FINISH_REASONS, PrometheusStatLogger, token_buckets
from metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats

MODEL = "smollm2-135m-instruct"


def samples(logger: PrometheusStatLogger) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """{(sample name, sorted labels): value} from the exposition text, as a scraper would read it."""
    body, content_type = logger.render()
    assert content_type.startswith("text/plain")
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def value(logger: PrometheusStatLogger, name: str, **labels: str) -> float:
    return samples(logger)[(name, tuple(sorted({"model_name": MODEL, **labels}.items())))]


def finished(reason: str = "stop", prompt: int = 10, gen: int = 4, **kw: Any) -> FinishedRequestStats:
    d: dict[str, Any] = dict(num_cached_tokens=0, e2e_latency=1.0, queue_time=0.1, ttft=0.3)
    d["mean_times_per_output_token"] = []
    d.update(kw)
    return FinishedRequestStats(reason, prompt, gen, **d)


def test_counters_exist_at_zero_before_any_step() -> None:
    log = PrometheusStatLogger(MODEL)
    for name in ("brine_prefix_cache_queries_total", "brine_prefix_cache_hits_total",
                 "brine_prefix_cache_preempted_queries_total", "brine_prefix_cache_preempted_hits_total",
                 "brine_prefix_cache_evictions_total", "brine_num_preemptions_total",
                 "brine_prompt_tokens_total", "brine_generation_tokens_total"):  # fmt: skip
        assert value(log, name) == 0.0
    for reason in FINISH_REASONS:
        assert value(log, "brine_request_success_total", finished_reason=reason) == 0.0
    assert value(log, "brine_kv_cache_usage_perc") == 0.0
    assert value(log, "brine_time_to_first_token_seconds_count") == 0.0


def test_prefix_cache_counters_accumulate_tokens_and_keep_preempted_apart() -> None:
    log = PrometheusStatLogger(MODEL)
    log.record(SchedulerStats(prefix_cache=PrefixCacheStats(queries=1000, hits=0)), IterationStats())
    log.record(SchedulerStats(prefix_cache=PrefixCacheStats(queries=1010, hits=992)), IterationStats())
    log.record(
        SchedulerStats(num_preemptions=2,
                       prefix_cache=PrefixCacheStats(preempted_queries=300, preempted_hits=288, evictions=5)),
        IterationStats(),
    )  # fmt: skip
    assert value(log, "brine_prefix_cache_queries_total") == 2010
    assert value(log, "brine_prefix_cache_hits_total") == 992
    assert value(log, "brine_prefix_cache_preempted_queries_total") == 300
    assert value(log, "brine_prefix_cache_preempted_hits_total") == 288
    assert value(log, "brine_num_preemptions_total") == 2
    assert value(log, "brine_prefix_cache_evictions_total") == 5


def test_gauges_show_the_latest_step() -> None:
    log = PrometheusStatLogger(MODEL)
    log.record(SchedulerStats(num_running=3, num_waiting=2, kv_cache_usage=0.5, num_cached_blocks=40),
               IterationStats())  # fmt: skip
    log.record(SchedulerStats(num_running=1, num_waiting=0, kv_cache_usage=0.125, num_cached_blocks=64),
               IterationStats())  # fmt: skip
    assert value(log, "brine_num_requests_running") == 1
    assert value(log, "brine_num_requests_waiting") == 0
    assert value(log, "brine_kv_cache_usage_perc") == 0.125
    assert value(log, "brine_num_cached_blocks") == 64


def test_tokens_requests_and_histograms() -> None:
    log = PrometheusStatLogger(MODEL)
    log.record(
        SchedulerStats(), IterationStats(num_prompt_tokens=20, num_generation_tokens=2, ttfts=[0.3, 0.7])
    )
    log.record(
        SchedulerStats(),
        IterationStats(
            num_generation_tokens=2,
            inter_token_latencies=[0.02, 0.04],
            finished=[finished("stop", prompt=12, gen=3, e2e_latency=2.0, queue_time=0.25,
                               mean_times_per_output_token=[0.03]),
                      finished("length", prompt=8, gen=1, e2e_latency=0.5, queue_time=0.75)],
        ),
    )  # fmt: skip
    assert value(log, "brine_prompt_tokens_total") == 20
    assert value(log, "brine_generation_tokens_total") == 4
    assert value(log, "brine_request_success_total", finished_reason="stop") == 1
    assert value(log, "brine_request_success_total", finished_reason="length") == 1
    assert value(log, "brine_request_success_total", finished_reason="abort") == 0
    assert value(log, "brine_time_to_first_token_seconds_count") == 2
    assert value(log, "brine_time_to_first_token_seconds_sum") == pytest.approx(1.0)
    assert value(log, "brine_time_to_first_token_seconds_bucket", le="0.5") == 1
    assert value(log, "brine_time_to_first_token_seconds_bucket", le="+Inf") == 2
    assert value(log, "brine_inter_token_latency_seconds_count") == 2
    assert value(log, "brine_inter_token_latency_seconds_sum") == pytest.approx(0.06)
    assert value(log, "brine_e2e_request_latency_seconds_sum") == pytest.approx(2.5)
    assert value(log, "brine_request_queue_time_seconds_sum") == pytest.approx(1.0)
    assert value(log, "brine_request_prompt_tokens_sum") == 20
    assert value(log, "brine_request_prompt_tokens_bucket", le="10.0") == 1
    assert value(log, "brine_request_generation_tokens_sum") == 4
    # A one-token request has no time between tokens: only the 3-token request is observed.
    assert value(log, "brine_time_per_output_token_seconds_count") == 1
    assert value(log, "brine_time_per_output_token_seconds_sum") == pytest.approx(0.03)


def test_per_sequence_token_times_and_a_request_never_scheduled() -> None:
    log = PrometheusStatLogger(MODEL)
    # n=2, both sequences decoded; then a request aborted while waiting: no queue time, no token times.
    log.record(SchedulerStats(), IterationStats(finished=[
        finished("length", gen=6, queue_time=0.5, mean_times_per_output_token=[0.01, 0.05]),
        finished("abort", gen=0, e2e_latency=3.0, queue_time=None, ttft=None)]))  # fmt: skip
    assert value(log, "brine_time_per_output_token_seconds_count") == 2
    assert value(log, "brine_time_per_output_token_seconds_sum") == pytest.approx(0.06)
    assert value(log, "brine_request_queue_time_seconds_count") == 1
    assert value(log, "brine_request_queue_time_seconds_sum") == pytest.approx(0.5)
    assert value(log, "brine_e2e_request_latency_seconds_count") == 2
    assert value(log, "brine_request_success_total", finished_reason="abort") == 1


def test_enum_finish_reason_uses_its_value() -> None:
    from enum import Enum

    class Reason(str, Enum):
        ABORT = "abort"

    log = PrometheusStatLogger(MODEL)
    log.record(SchedulerStats(), IterationStats(finished=[finished(Reason.ABORT)]))  # type: ignore[arg-type]
    assert value(log, "brine_request_success_total", finished_reason="abort") == 1


def test_registries_are_separate_and_labels_carry_nothing_tenant_specific() -> None:
    a, b = PrometheusStatLogger(MODEL), PrometheusStatLogger(MODEL)
    a.record(SchedulerStats(prefix_cache=PrefixCacheStats(queries=7)), IterationStats())
    assert value(a, "brine_prefix_cache_queries_total") == 7
    assert value(b, "brine_prefix_cache_queries_total") == 0
    label_names = {name for (_, labels) in samples(a) for name, _ in labels}
    assert label_names <= {"model_name", "finished_reason", "kind", "le", "tier"}
    assert all(name.startswith("brine_") for (name, _) in samples(a))


def test_render_is_consistent_while_another_thread_records() -> None:
    log = PrometheusStatLogger(MODEL)
    stop = threading.Event()

    def engine() -> None:
        while not stop.is_set():
            log.record(SchedulerStats(prefix_cache=PrefixCacheStats(queries=10, hits=10)), IterationStats())

    t = threading.Thread(target=engine)
    t.start()
    try:
        for _ in range(50):
            s = samples(log)
            key = tuple(sorted({"model_name": MODEL}.items()))
            # Each step adds queries and hits together: a scrape must never see one without the other.
            assert s[("brine_prefix_cache_queries_total", key)] == s[("brine_prefix_cache_hits_total", key)]
    finally:
        stop.set()
        t.join()


def test_token_buckets() -> None:
    assert token_buckets(60) == (1.0, 2.0, 5.0, 10.0, 20.0, 50.0)


def test_metrics_package_imports_neither_torch_nor_engine() -> None:
    # kv_cache (torch-free) is below metrics: its PrefixCacheStats record flows to the loggers whole.
    code = "import sys, metrics; bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'engine', 'server')]; print(bad); sys.exit(1 if bad else 0)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_kv_cache_never_imports_metrics_or_torch() -> None:
    code = "import sys, kv_cache; bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'engine', 'server', 'metrics')]; print(bad); sys.exit(1 if bad else 0)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stdout + proc.stderr


@pytest.mark.parametrize(
    "name", ["brine_time_to_first_token_seconds", "brine_e2e_request_latency_seconds",
             "brine_request_queue_time_seconds"],
)  # fmt: skip
def test_cpu_scale_latencies_land_in_distinct_finite_buckets(name: str) -> None:
    # A 2-core CPU prefills a few thousand tokens in seconds to tens of seconds: those must not all fall into
    # +Inf (or one bucket), or histogram_quantile says nothing.
    seconds = [1.5, 3.0, 12.0, 45.0, 150.0]
    log = PrometheusStatLogger(MODEL)
    log.record(SchedulerStats(), IterationStats(ttfts=seconds, finished=[
        finished(e2e_latency=s, queue_time=s) for s in seconds]))  # fmt: skip
    buckets = sorted(
        (float(dict(labels)["le"]), v) for (n, labels), v in samples(log).items() if n == f"{name}_bucket"
    )
    finite = [(le, v) for le, v in buckets if le != float("inf")]
    assert finite[-1][1] == len(seconds)  # every observation is below the largest finite bound
    assert len({v for _, v in finite if 0 < v}) == len(seconds)  # and each one in a bucket of its own


def test_structured_output_requests_by_kind_and_grammar_compile_times() -> None:
    log = PrometheusStatLogger(MODEL)
    log.count_structured_output("json_schema")
    log.count_structured_output("json_schema")
    log.count_structured_output("regex")
    log.count_structured_output("no-such-kind")  # not a kind: ignored, never a new series
    counts = {
        kind: value(log, "brine_structured_output_requests_total", kind=kind)
        for kind in ("json_object", "json_schema", "regex", "choice", "grammar")
    }
    assert counts == {"json_object": 0, "json_schema": 2, "regex": 1, "choice": 0, "grammar": 0}
    assert not any(dict(labels).get("kind") == "no-such-kind" for _, labels in samples(log))
    log.observe_grammar_compile(0.003)
    log.observe_grammar_compile(0.2)
    assert value(log, "brine_grammar_compile_seconds_count") == 2
    assert value(log, "brine_grammar_compile_seconds_sum") == pytest.approx(0.203)
    assert value(log, "brine_grammar_compile_seconds_bucket", le="0.005") == 1
