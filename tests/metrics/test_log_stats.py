"""LoggingStatLogger and CacheHitWindow, driven by a fake clock."""

from __future__ import annotations

import logging
import time

import pytest

from kv_cache.stats import PrefixCacheStats
from metrics.log_stats import CacheHitWindow, LoggingStatLogger
from metrics.stats import IterationStats, SchedulerStats


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


def lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "brine.metrics"]


def test_window_keeps_the_last_n_requests() -> None:
    w = CacheHitWindow(max_requests=3)
    assert w.hit_rate is None
    w.observe(1, 100, 0)
    w.observe(1, 100, 50)
    w.observe(1, 100, 100)
    assert (w.requests, w.queries, w.hits) == (3, 300, 150)
    w.observe(1, 100, 100)  # the cold first request falls out of the window
    assert (w.requests, w.queries, w.hits) == (3, 300, 250)
    assert w.hit_rate == pytest.approx(250 / 300)
    w.observe(5, 500, 0)  # one step bigger than the window still stays, alone
    assert (w.requests, w.queries, w.hits) == (5, 500, 0)
    w.observe(0, 0, 0)  # steps without lookups do not count
    assert w.requests == 5
    with pytest.raises(ValueError):
        CacheHitWindow(0)


def test_logs_every_tick_with_throughput_and_hit_rate(
    clock: FakeClock, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="brine.metrics")
    log = LoggingStatLogger(interval=10.0, clock=clock, autostart=False)
    clock.t += 4
    log.record(SchedulerStats(num_running=1, kv_cache_usage=0.25,
                              prefix_cache=PrefixCacheStats(queries=1000, requests=1)),
               IterationStats(num_prompt_tokens=1000, num_generation_tokens=1))  # fmt: skip
    log.record(SchedulerStats(num_running=2, num_waiting=1, kv_cache_usage=0.5,
                              prefix_cache=PrefixCacheStats(queries=1000, hits=992, requests=1)),
               IterationStats(num_prompt_tokens=8, num_generation_tokens=2))  # fmt: skip
    assert lines(caplog) == []  # record() never logs: the timer does
    clock.t += 6
    log.tick()
    assert lines(caplog) == [
        "Avg prompt throughput: 100.8 tokens/s, Avg generation throughput: 0.3 tokens/s, Running: 2 reqs, "
        "Waiting: 1 reqs, KV cache usage: 50.0%, Prefix cache hit rate: 49.6% (992/2000 tokens, last 2 requests)"
    ]
    # The next window starts empty for throughput; the hit rate still covers the recent requests.
    log.record(SchedulerStats(num_running=2), IterationStats(num_generation_tokens=50))
    clock.t += 20
    log.tick()
    assert lines(caplog)[-1].startswith(
        "Avg prompt throughput: 0.0 tokens/s, Avg generation throughput: 2.5 tokens/s"
    )
    assert lines(caplog)[-1].endswith("49.6% (992/2000 tokens, last 2 requests)")


def test_no_lookup_yet_says_na_not_zero(clock: FakeClock) -> None:
    log = LoggingStatLogger(clock=clock, autostart=False)
    log.record(SchedulerStats(num_running=1), IterationStats(num_generation_tokens=4))
    clock.t += 2
    assert log.format_line().endswith("Prefix cache hit rate: n/a")
    assert "Avg generation throughput: 2.0 tokens/s" in log.format_line()


def test_quiet_while_idle(clock: FakeClock, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="brine.metrics")
    log = LoggingStatLogger(interval=10.0, clock=clock, autostart=False)
    clock.t += 10
    log.tick()  # nothing has happened yet
    assert lines(caplog) == []
    log.record(SchedulerStats(num_running=0), IterationStats(num_generation_tokens=20))  # last request ends
    clock.t += 10
    log.tick()
    clock.t += 10
    log.tick()  # one idle line, showing the drop to zero
    clock.t += 10
    log.tick()  # then silence
    assert len(lines(caplog)) == 2
    assert "Avg generation throughput: 2.0 tokens/s" in lines(caplog)[0]
    assert "Avg generation throughput: 0.0 tokens/s, Running: 0 reqs" in lines(caplog)[1]


def test_timer_thread_logs_while_busy(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="brine.metrics")
    log = LoggingStatLogger(interval=0.05)
    try:
        log.record(SchedulerStats(num_running=1), IterationStats(num_generation_tokens=3))
        deadline = time.monotonic() + 10
        while not lines(caplog) and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        log.close()
    assert lines(caplog) and "Running: 1 reqs" in lines(caplog)[0]


def test_steps_without_request_count_count_as_one_request(clock: FakeClock) -> None:
    log = LoggingStatLogger(window_requests=1, clock=clock, autostart=False)
    log.record(SchedulerStats(prefix_cache=PrefixCacheStats(queries=100)), IterationStats())
    log.record(SchedulerStats(prefix_cache=PrefixCacheStats(queries=100, hits=96)), IterationStats())
    assert (log.window.requests, log.window.queries, log.window.hits) == (1, 100, 96)


def test_a_prefix_cache_reset_starts_the_hit_rate_window_afresh(clock: FakeClock) -> None:
    log = LoggingStatLogger(clock=clock, autostart=False)
    log.record(SchedulerStats(prefix_cache=PrefixCacheStats(queries=100, hits=90, requests=1)),
               IterationStats())  # fmt: skip
    assert log.window.hit_rate == 0.9
    log.record(SchedulerStats(prefix_cache_reset=True), IterationStats())
    assert log.window.hit_rate is None and log.window.requests == 0
    log.record(SchedulerStats(prefix_cache=PrefixCacheStats(queries=100, hits=0, requests=1)),
               IterationStats())  # fmt: skip
    assert log.window.hit_rate == 0.0  # hits from before the reset no longer count
