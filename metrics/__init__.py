"""metrics: per-step stats records, the Prometheus exporter and the periodic log line.

Imports the stdlib, prometheus-client and kv_cache's torch-free records only (no torch, no engine), so the
engine can import the records and the server can serve `/metrics` without pulling in each other.
"""

from metrics.log_stats import CacheHitWindow, LoggingStatLogger
from metrics.prometheus import PrometheusStatLogger
from metrics.stats import FinishedRequestStats, IterationStats, SchedulerStats, StatLogger

__all__ = [
    "CacheHitWindow",
    "FinishedRequestStats",
    "IterationStats",
    "LoggingStatLogger",
    "PrometheusStatLogger",
    "SchedulerStats",
    "StatLogger",
]
