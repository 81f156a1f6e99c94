"""The stat loggers' hooks are on the `StatLogger` Protocol, so the engine calls them directly: a logger that
subclasses it inherits no-ops for the hooks it does not export, and the exporters override what they do."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from metrics.log_stats import LoggingStatLogger
from metrics.prometheus import PrometheusStatLogger
from metrics.stats import IterationStats, SchedulerStats, StatLogger


class OnlyRecords(StatLogger):
    def __init__(self) -> None:
        self.steps = 0

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.steps += 1


def sample(log: PrometheusStatLogger, name: str, **labels: str) -> float:
    body, _ = log.render()
    for family in text_string_to_metric_families(body.decode()):
        for s in family.samples:
            if s.name == name and s.labels == {"model_name": "m", **labels}:
                return s.value
    raise KeyError(name)


def test_a_logger_that_defines_only_record_takes_every_hook() -> None:
    log = OnlyRecords()
    for hooked in (log, LoggingStatLogger(autostart=False)):
        assert hooked.count_structured_output("json_schema") is None
        assert hooked.observe_grammar_compile(0.5) is None
    log.record(SchedulerStats(), IterationStats())
    assert log.steps == 1


def test_prometheus_overrides_the_hooks() -> None:
    prom = PrometheusStatLogger("m")
    prom.count_structured_output("regex")
    prom.count_structured_output("no such kind")  # not a series: ignored, as before
    prom.observe_grammar_compile(0.02)
    assert sample(prom, "brine_structured_output_requests_total", kind="regex") == 1
    assert sample(prom, "brine_grammar_compile_seconds_count") == 1
    assert PrometheusStatLogger.count_structured_output is not StatLogger.count_structured_output


def test_every_field_that_declares_a_metric_is_exported_as_declared() -> None:
    """A plain counter or gauge is declared on its record's field (`metric_field`), and the exporter needs no
    line of its own for it: each declared field, set to 3 in one record, reads 3 under its name."""
    from dataclasses import fields

    from kv_cache.stats import PrefixCacheStats

    declared = 0
    for record_type in (SchedulerStats, PrefixCacheStats, IterationStats):
        for f in fields(record_type):
            if "metric" not in f.metadata:
                continue
            kind, name, doc = f.metadata["metric"]
            prom = PrometheusStatLogger("m")
            s, it = SchedulerStats(), IterationStats()
            target = {SchedulerStats: s, PrefixCacheStats: s.prefix_cache, IterationStats: it}[record_type]
            setattr(target, f.name, 3)
            prom.record(s, it)
            prom.record(
                SchedulerStats(), IterationStats()
            )  # a counter keeps its 3, a gauge follows the state
            assert sample(prom, name + "_total" if kind == "counter" else name) == (
                3 if kind == "counter" else 0
            )
            assert doc and name.startswith("brine_")
            declared += 1
    assert declared == 16  # the plain metrics: the rest (labels, histograms, derived) are written out
