"""The records a benchmark run produces (one per request, one per workload), shared by the client that
fills them (`serve_bench`) and the code that summarizes and charts them (`report`, `compare`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field


@dataclass(slots=True)
class RequestResult:
    tag: str
    group: str
    salt: str | None
    ok: bool = False
    error: str | None = None
    ttft: float | None = None  # seconds from sending to the first non-empty text
    e2e: float | None = None
    itls: list[float] = field(default_factory=list)  # gaps between later text chunks
    prompt_tokens: int | None = None  # None where the server sent no usage
    cached_tokens: int | None = None
    completion_tokens: int | None = None
    start: float = 0.0  # seconds since the workload started


@dataclass(slots=True)
class WorkloadResult:
    workload: str
    server: str
    params: dict
    concurrency: int
    duration: float
    requests: list[RequestResult]
    cache_queries: float | None = None  # delta of brine_prefix_cache_queries_total over the run
    cache_hits: float | None = None
    kv_usage_peak: float | None = None  # highest brine_kv_cache_usage_perc seen while it ran (sample_kv)
    cached_blocks_end: float | None = None  # brine_num_cached_blocks once it finished (sample_kv)
    noise_sent: int = 0  # noisy-neighbour: the noisy tenant's requests, and how many succeeded
    noise_ok: int = 0

    @property
    def hit_rate(self) -> float | None:
        if self.cache_queries is None or self.cache_hits is None or self.cache_queries == 0:
            return None
        return self.cache_hits / self.cache_queries


def to_json(result: WorkloadResult) -> dict:
    return {**asdict(result), "hit_rate": result.hit_rate}
