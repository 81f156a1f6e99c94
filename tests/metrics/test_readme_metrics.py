"""docs/metrics.md's Metrics section documents exactly what `/metrics` exports, and the hit-rate PromQL."""

from __future__ import annotations

import re
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from metrics.prometheus import PrometheusStatLogger

METRICS_DOC = Path(__file__).resolve().parents[2] / "docs" / "metrics.md"


def metrics_section() -> str:
    text = METRICS_DOC.read_text()
    start = text.index("\n## Metrics\n")
    return text[start : text.index("\n## ", start + 1)]


def documented() -> set[str]:
    """Metric names in the first cell of the section's table rows (a `{label}` suffix dropped)."""
    names = re.findall(r"^\| `(brine_\w+)(?:\{[^}]*\})?` \|", metrics_section(), flags=re.MULTILINE)
    assert len(names) == len(set(names)), "a metric is documented twice"
    return set(names)


def exported() -> set[str]:
    """Names a scraper sees: counters with `_total`, histograms and gauges by family name. `_created`
    samples are prometheus-client's per-series timestamps, covered by one sentence, not a row each."""
    body, _ = PrometheusStatLogger("m").render()
    out = set()
    for family in text_string_to_metric_families(body.decode()):
        if family.type == "counter":
            out.add(family.name + "_total")
        elif not family.name.endswith("_created"):
            out.add(family.name)
    return out


def test_readme_documents_every_exported_metric_and_no_other() -> None:
    assert documented() == exported()


def test_readme_shows_the_hit_rate_promql() -> None:
    assert (
        "increase(brine_prefix_cache_hits_total[5m]) / increase(brine_prefix_cache_queries_total[5m])"
        in metrics_section()
    )
