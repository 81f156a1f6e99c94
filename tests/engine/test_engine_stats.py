"""Engine stats that feed `/metrics`: per-sequence token timings with n > 1, queue time of a request that was
never scheduled, and gauges right after a prefix-cache reset.

Timings run on a fake clock (patched into the engine modules) that the test advances by 1 s per step, so the
expected values are exact and no assertion depends on wall-clock time.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from engine_fakes import ByteTokenizer, FakeRunner, RecordingLogger, make_core, run_to_completion
from prometheus_client.parser import text_string_to_metric_families

import engine.engine_core
import engine.output_processor
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.sampling_params import SamplingParams
from kv_cache.stats import PrefixCacheStats
from metrics.prometheus import PrometheusStatLogger
from metrics.stats import FinishedRequestStats

MODEL = "fake"


@dataclass(slots=True)
class FakeClock:
    """Stands in for the `time` module inside the engine: only `monotonic()` is used there."""

    now: float = 0.0

    def monotonic(self) -> float:
        return self.now


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> FakeClock:
    c = FakeClock()
    monkeypatch.setattr(engine.engine_core, "time", c)
    monkeypatch.setattr(engine.output_processor, "time", c)
    return c


def metric(log: PrometheusStatLogger, name: str, **labels: str) -> float:
    body, _ = log.render()
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == name and s.labels == {"model_name": MODEL, **labels}:
                return s.value
    raise KeyError(name)


def step_every_second(core: EngineCore, clock: FakeClock) -> None:
    """Steps until idle, one fake second per step (checking the KV cache after each, leaving no block held)."""
    while core.has_work():
        clock.now += 1.0
        core.step()
        core.kv_manager.check_invariants()
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks


def finished_stats(log: RecordingLogger) -> list[FinishedRequestStats]:
    return [f for _, it in log.records for f in it.finished]


def test_time_per_output_token_is_per_sequence_with_n_greater_than_1(clock: FakeClock) -> None:
    rec, prom = RecordingLogger(), PrometheusStatLogger(MODEL)
    core = make_core(FakeRunner(num_blocks=64, block_size=4), stat_loggers=[rec, prom])
    core.add_request("r", list(range(1, 8)), SamplingParams(n=3, max_tokens=5, seed=1), arrival_time=0.0)
    step_every_second(core, clock)
    # Each sequence gets one token per step: first at t=1, fifth at t=5, so 4 s over 4 tokens after the first.
    # Pooling the three sequences' 15 tokens over one 4 s stretch would give 4/14 s instead.
    [f] = finished_stats(rec)
    assert f.num_generation_tokens == 15
    assert f.mean_times_per_output_token == [1.0, 1.0, 1.0]
    assert metric(prom, "brine_time_per_output_token_seconds_count") == 3
    assert metric(prom, "brine_time_per_output_token_seconds_sum") == pytest.approx(3.0)
    # TTFT is observed the same way: once per sequence (as vLLM does for its n child requests).
    assert sorted(t for _, it in rec.records for t in it.ttfts) == [1.0, 1.0, 1.0]
    assert metric(prom, "brine_time_to_first_token_seconds_count") == 3
    # The request counter and the per-request histograms stay per request.
    assert metric(prom, "brine_request_success_total", finished_reason="length") == 1
    assert metric(prom, "brine_e2e_request_latency_seconds_count") == 1


def test_time_per_output_token_ends_at_the_last_token_not_at_the_abort(clock: FakeClock) -> None:
    rec = RecordingLogger()
    core = make_core(FakeRunner(num_blocks=64, block_size=4), stat_loggers=[rec])
    core.add_request("r", [1, 2, 3], SamplingParams(max_tokens=100, temperature=0), arrival_time=0.0)
    for _ in range(3):  # tokens at t=1, 2, 3
        clock.now += 1.0
        core.step()
    clock.now = 100.0  # the client goes away long after its last token
    core.abort_request("r")
    step_every_second(core, clock)
    [f] = finished_stats(rec)
    assert (f.finish_reason, f.num_generation_tokens) == ("abort", 3)
    assert f.mean_times_per_output_token == [1.0]  # (3 - 1) / 2, not (100 - 1) / 2
    assert f.ttft == 1.0 and f.queue_time == 1.0 and f.e2e_latency == 100.0


def test_a_request_aborted_before_it_was_scheduled_records_no_queue_time(clock: FakeClock) -> None:
    rec, prom = RecordingLogger(), PrometheusStatLogger(MODEL)
    core = make_core(FakeRunner(num_blocks=64, block_size=4), stat_loggers=[rec, prom])
    core.add_request("never", [1, 2, 3], SamplingParams(max_tokens=4), arrival_time=0.0)
    clock.now = 5.0
    core.abort_request("never")
    step_every_second(core, clock)
    [f] = finished_stats(rec)
    assert f.finish_reason == "abort"
    # It never left the queue: it has no queue time (0.0 would claim it was scheduled at once), no first token.
    assert f.queue_time is None and f.ttft is None and f.mean_times_per_output_token == []
    assert metric(prom, "brine_request_queue_time_seconds_count") == 0
    assert metric(prom, "brine_time_to_first_token_seconds_count") == 0
    assert metric(prom, "brine_e2e_request_latency_seconds_count") == 1
    assert metric(prom, "brine_e2e_request_latency_seconds_sum") == 5.0


def test_a_request_scheduled_late_records_its_real_queue_time(clock: FakeClock) -> None:
    rec = RecordingLogger()
    core = make_core(FakeRunner(num_blocks=64, block_size=4), stat_loggers=[rec])
    core.add_request("late", [1, 2, 3], SamplingParams(max_tokens=2), arrival_time=0.0)
    clock.now = 2.0  # the first step is at t=3
    step_every_second(core, clock)
    [f] = finished_stats(rec)
    assert f.queue_time == 3.0 and f.ttft == 3.0


def test_core_reset_prefix_cache_records_the_emptied_cache_at_once() -> None:
    prom = PrometheusStatLogger(MODEL)
    core = make_core(FakeRunner(num_blocks=64, block_size=4), stat_loggers=[prom])
    core.add_request("a", list(range(1, 30)), SamplingParams(max_tokens=2))
    run_to_completion(core)
    assert metric(prom, "brine_num_cached_blocks") == core.kv_manager.num_cached_blocks > 0
    assert core.reset_prefix_cache()
    assert core.kv_manager.num_cached_blocks == 0
    assert metric(prom, "brine_num_cached_blocks") == 0  # no step needed


def test_a_refused_reset_changes_nothing() -> None:
    rec = RecordingLogger()
    core = make_core(FakeRunner(num_blocks=64, block_size=4), stat_loggers=[rec])
    core.add_request("a", list(range(1, 30)), SamplingParams(max_tokens=3))
    core.step()  # "a" now holds blocks
    records = len(rec.records)
    assert not core.reset_prefix_cache()
    assert len(rec.records) == records and core.kv_manager.num_cached_blocks > 0
    run_to_completion(core)
    assert not any(s.prefix_cache_reset for s, _ in rec.records)  # steps are not resets
    assert core.reset_prefix_cache()
    assert rec.records[-1][0].prefix_cache_reset  # so the log line's hit-rate window starts afresh


async def test_async_reset_prefix_cache_updates_the_gauges_without_a_request() -> None:
    prom = PrometheusStatLogger(MODEL)
    core = EngineCore(
        FakeRunner(num_blocks=64, block_size=4), ByteTokenizer(), EngineConfig(stat_loggers=[prom])
    )
    eng = AsyncEngine(core, core.tokenizer, model_name=MODEL)
    try:
        outs = [o async for o in eng.generate(list(range(1, 30)), SamplingParams(max_tokens=2))]
        assert outs[-1].finished and eng.num_used_blocks() == 0
        assert metric(prom, "brine_num_cached_blocks") == 7  # 29 prompt + 1 output token in blocks of 4
        queries = metric(prom, "brine_prefix_cache_queries_total")
        assert eng.reset_prefix_cache()
        assert metric(prom, "brine_num_cached_blocks") == 0
        assert metric(prom, "brine_kv_cache_usage_perc") == 0
        assert metric(prom, "brine_prefix_cache_queries_total") == queries  # counters are not reset
    finally:
        eng.shutdown()


def test_the_kv_managers_prefix_cache_record_reaches_the_loggers_whole() -> None:
    """One record from kv_cache to Prometheus: what the manager counted is what every logger gets, every
    field of it (none listed again on the way), and Prometheus shows its counters."""
    rec, prom = RecordingLogger(), PrometheusStatLogger(MODEL)
    core = make_core(FakeRunner(num_blocks=64, block_size=4), stat_loggers=[rec, prom])
    counted: list[PrefixCacheStats] = []
    make_stats = core.kv_manager.make_prefix_cache_stats

    def spy() -> PrefixCacheStats:
        counted.append(make_stats())
        return counted[-1]

    core.kv_manager.make_prefix_cache_stats = spy  # type: ignore[method-assign]
    for rid in ("a", "b"):  # b hits a's two full blocks
        core.add_request(rid, list(range(1, 10)), SamplingParams(max_tokens=2, temperature=0))
        run_to_completion(core)
    assert [s.prefix_cache for s, _ in rec.records] == counted  # the same records, in order
    assert all(s.prefix_cache is c for (s, _), c in zip(rec.records, counted, strict=True))
    assert sum(c.hits for c in counted) == 8 and sum(c.queries for c in counted) == 18
    assert metric(prom, "brine_prefix_cache_hits_total") == 8
    assert metric(prom, "brine_prefix_cache_queries_total") == 18
