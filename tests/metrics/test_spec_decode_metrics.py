"""Speculative decoding's counters (vLLM's spec_decode names) and its part of the periodic log line."""

from __future__ import annotations

import logging

import pytest
from prometheus_client.parser import text_string_to_metric_families

from metrics.log_stats import LoggingStatLogger
from metrics.prometheus import PrometheusStatLogger
from metrics.stats import IterationStats, SchedulerStats, SpecDecodingStats


def spec(*drafts: tuple[int, int]) -> SpecDecodingStats:
    """(draft tokens, accepted) per draft."""
    sd = SpecDecodingStats()
    for n, a in drafts:
        sd.observe(n, a)
    return sd


def test_observe_counts_per_position() -> None:
    sd = spec((4, 4), (4, 1), (2, 0))
    assert (sd.num_drafts, sd.num_draft_tokens, sd.num_accepted_tokens) == (3, 10, 5)
    assert sd.num_accepted_tokens_per_pos == [2, 1, 1, 1]


def values(logger: PrometheusStatLogger) -> dict[tuple[str, str], float]:
    body, _ = logger.render()
    out = {}
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name.startswith("brine_spec_decode") and not s.name.endswith("_created"):
                out[(s.name, s.labels.get("position", ""))] = s.value
    return out


def test_prometheus_counters_accumulate_and_positions_appear_when_reached() -> None:
    logger = PrometheusStatLogger("m")
    assert values(logger) == {
        ("brine_spec_decode_num_drafts_total", ""): 0.0,
        ("brine_spec_decode_num_draft_tokens_total", ""): 0.0,
        ("brine_spec_decode_num_accepted_tokens_total", ""): 0.0,
    }
    logger.record(SchedulerStats(), IterationStats(spec_decoding=spec((3, 2), (1, 0))))
    logger.record(SchedulerStats(), IterationStats())  # a step without drafts changes nothing
    logger.record(SchedulerStats(), IterationStats(spec_decoding=spec((4, 4))))
    got = values(logger)
    assert got[("brine_spec_decode_num_drafts_total", "")] == 3
    assert got[("brine_spec_decode_num_draft_tokens_total", "")] == 8
    assert got[("brine_spec_decode_num_accepted_tokens_total", "")] == 6
    per_pos = {p: v for (name, p), v in got.items() if name.endswith("per_pos_total")}
    assert per_pos == {"0": 2, "1": 2, "2": 1, "3": 1}


def test_log_line_shows_the_acceptance_rate_only_for_windows_with_drafts(
    caplog: pytest.LogCaptureFixture,
) -> None:
    t = [100.0]
    logger = LoggingStatLogger(interval=10, clock=lambda: t[0], autostart=False)
    with caplog.at_level(logging.INFO, logger="brine.metrics"):
        logger.record(SchedulerStats(num_running=1), IterationStats(num_generation_tokens=5))
        t[0] += 10
        logger.tick()
        logger.record(
            SchedulerStats(num_running=1),
            IterationStats(num_generation_tokens=9, spec_decoding=spec((4, 3), (4, 1))),
        )
        t[0] += 10
        logger.tick()
    lines = [r.getMessage() for r in caplog.records if r.name == "brine.metrics"]
    assert "Spec decode" not in lines[0]
    assert lines[1].endswith(
        "Spec decode acceptance rate: 50.0% (4/8 draft tokens), mean acceptance length 3.00"
    )


def test_log_line_shows_the_windows_latest_draft_threshold(caplog: pytest.LogCaptureFixture) -> None:
    t = [100.0]
    logger = LoggingStatLogger(interval=10, clock=lambda: t[0], autostart=False)
    first, second = spec((4, 3)), spec((2, 0))
    first.threshold, second.threshold = 0.3, 0.0625
    with caplog.at_level(logging.INFO, logger="brine.metrics"):
        for sd in (first, second, spec((1, 1))):  # the last step's threshold unknown: the latest known stays
            logger.record(
                SchedulerStats(num_running=1), IterationStats(num_generation_tokens=3, spec_decoding=sd)
            )
        t[0] += 10
        logger.tick()
    lines = [r.getMessage() for r in caplog.records if r.name == "brine.metrics"]
    assert lines[0].endswith("(4/7 draft tokens), mean acceptance length 2.33, draft threshold 0.062")
