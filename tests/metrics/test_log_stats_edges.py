"""LoggingStatLogger edges that `make mutate` found untested: the idle line comes exactly once and at once,
waiting requests alone count as busy, a window of zero length says n/a, the window's end is the one given,
the documented defaults, and the timer thread's lifecycle."""

from __future__ import annotations

import logging
import threading

import pytest

from metrics.log_stats import CacheHitWindow, LoggingStatLogger
from metrics.stats import IterationStats, SchedulerStats


class FakeClock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def _count(caplog: pytest.LogCaptureFixture) -> int:
    return sum(r.name == "brine.metrics" for r in caplog.records)


def test_the_idle_line_comes_on_the_first_idle_tick_and_only_then(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="brine.metrics")
    clock = FakeClock()
    log = LoggingStatLogger(clock=clock, autostart=False)
    counts = []
    for busy in (False, True, False, False, False, True, False, False):
        if busy:
            log.record(SchedulerStats(), IterationStats(num_generation_tokens=5))
        clock.t += 10
        log.tick()
        counts.append(_count(caplog))
    assert counts == [0, 1, 2, 2, 2, 3, 4, 4]


def test_waiting_requests_alone_keep_the_line_coming(caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="brine.metrics")
    clock = FakeClock()
    log = LoggingStatLogger(clock=clock, autostart=False)
    log.record(SchedulerStats(num_running=0, num_waiting=3), IterationStats())
    for expected in (1, 2, 3):  # no tokens, nothing running: queued work is still work
        clock.t += 10
        log.tick()
        assert _count(caplog) == expected
    assert "Waiting: 3 reqs" in caplog.records[-1].getMessage()


def test_throughput_over_the_window_that_ends_where_asked() -> None:
    clock = FakeClock()
    log = LoggingStatLogger(clock=clock, autostart=False)
    log.record(SchedulerStats(), IterationStats(num_prompt_tokens=8, num_generation_tokens=2))
    assert "Avg prompt throughput: n/a, Avg generation throughput: n/a" in log.format_line()  # zero length
    assert "Avg prompt throughput: 16.0 tokens/s" in log.format_line(end=clock.t + 0.5)
    clock.t += 10
    assert "Avg prompt throughput: 2.0 tokens/s" in log.format_line(end=clock.t - 6)


def test_documented_defaults_and_window_rules() -> None:
    log = LoggingStatLogger(autostart=False)
    assert log.interval == 10.0 and log.window.max_requests == 1000
    assert CacheHitWindow().max_requests == 1000
    with pytest.raises(ValueError, match=r"^max_requests must be >= 1$"):
        CacheHitWindow(0)
    w = CacheHitWindow(5)
    w.observe(2, 0, 0)  # requests whose lookups had no tokens to look up still count as requests
    w.observe(0, 0, 0)  # a step without lookups changes nothing
    assert (w.requests, w.queries, w.hits) == (2, 0, 0) and w.hit_rate is None


def test_the_timer_thread_is_a_named_daemon_that_close_stops() -> None:
    LoggingStatLogger(autostart=False).close()  # never started: nothing to stop, no error
    log = LoggingStatLogger(interval=0.01)
    log.record(SchedulerStats(num_running=1), IterationStats())
    [thread] = [t for t in threading.enumerate() if t.name == "brine-log-stats" and t is log._thread]
    assert thread.daemon and thread.is_alive()
    log.close()
    assert not thread.is_alive()
