"""LoRA's metrics: vLLM's lora_requests_info (one current series) and requests per adapter."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from metrics.prometheus import PrometheusStatLogger
from metrics.stats import IterationStats, SchedulerStats


def samples(logger: PrometheusStatLogger, name: str) -> list:
    body, _ = logger.render()
    return [s for f in text_string_to_metric_families(body.decode()) for s in f.samples if s.name == name]


def test_info_shows_the_current_adapters_only_and_requests_count_per_adapter() -> None:
    logger = PrometheusStatLogger("m")
    logger.record(SchedulerStats(), IterationStats())
    assert samples(logger, "brine_lora_requests_info") == []  # without --enable-lora: nothing
    step = SchedulerStats(
        max_lora=4,
        running_lora_adapters=("a", "b"),
        waiting_lora_adapters=("c",),
        lora_requests={"a": 2, "c": 1},
    )
    logger.record(step, IterationStats())
    logger.record(
        SchedulerStats(max_lora=4, running_lora_adapters=("c",), lora_requests={"a": 1}), IterationStats()
    )
    (info,) = samples(logger, "brine_lora_requests_info")
    assert info.labels == {
        "model_name": "m",
        "max_lora": "4",
        "running_lora_adapters": "c",
        "waiting_lora_adapters": "",
    }
    assert info.value > 1e9  # a Unix time
    counts = {s.labels["lora_name"]: s.value for s in samples(logger, "brine_lora_requests_total")}
    assert counts == {"a": 3, "c": 1}
