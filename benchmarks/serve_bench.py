"""Client side of the benchmarks: send a workload to any OpenAI-compatible server and time every token.

Per request: time to first token (TTFT), inter-token latencies, end-to-end latency, prompt / cached /
completion tokens (from the final usage chunk where the server sends one). A request counts as ok only when
its stream ends with a finish_reason and carries no error event. Around the run it reads the
server's `/metrics` and, where the `brine_prefix_cache_*` counters exist, reports the run's prefix-cache hit
rate as delta hits / delta queries; workloads that ask (`sample_kv`) also get the peak of
`brine_kv_cache_usage_perc` while they run and `brine_num_cached_blocks` at their end. Runs are bounded: a workload's request count, and a time limit after which
no new request starts.

    python -m benchmarks.serve_bench --base-url http://127.0.0.1:8000 --workload doc-qa
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import contextlib
import json
import random
import time

import httpx
from prometheus_client.parser import text_string_to_metric_families
from tqdm import tqdm

from benchmarks.results import RequestResult, WorkloadResult, to_json
from benchmarks.workloads import (
    TENANT_WORKLOADS,
    WORKLOADS,
    BenchRequest,
    Workload,
    build,
    write_server_files,
)

CACHE_COUNTERS = ("brine_prefix_cache_queries_total", "brine_prefix_cache_hits_total")


async def read_cache_counters(client: httpx.AsyncClient, base_url: str) -> tuple[float, float] | None:
    """(queries, hits) from /metrics, or None for a server without the brine counters."""
    try:
        r = await client.get(f"{base_url}/metrics", timeout=10)
    except httpx.HTTPError:
        return None
    if r.status_code != 200:
        return None
    found: dict[str, float] = {}
    try:
        for family in text_string_to_metric_families(r.text):
            for s in family.samples:
                if s.name in CACHE_COUNTERS:
                    found[s.name] = found.get(s.name, 0.0) + s.value
    except ValueError:  # not Prometheus text
        return None
    if set(found) != set(CACHE_COUNTERS):
        return None
    return found[CACHE_COUNTERS[0]], found[CACHE_COUNTERS[1]]


async def read_gauges(client: httpx.AsyncClient, base_url: str) -> dict[str, float]:
    """brine_kv_cache_usage_perc and brine_num_cached_blocks from /metrics ({} when not there)."""
    try:
        r = await client.get(f"{base_url}/metrics", timeout=10)
        if r.status_code != 200:
            return {}
        return {
            s.name: s.value
            for family in text_string_to_metric_families(r.text)
            for s in family.samples
            if s.name in ("brine_kv_cache_usage_perc", "brine_num_cached_blocks")
        }
    except (httpx.HTTPError, ValueError):
        return {}


async def send(
    client: httpx.AsyncClient, base_url: str, model: str, req: BenchRequest, api: str, t0: float
) -> RequestResult:
    res = RequestResult(req.tag, req.group, req.salt)
    body: dict = {"model": model, "max_tokens": req.max_tokens, "temperature": 0.0, "stream": True,
                  "stream_options": {"include_usage": True}}  # fmt: skip
    if api == "chat":
        system = [{"role": "system", "content": req.system}] if req.system is not None else []
        body["messages"] = [*system, {"role": "user", "content": req.prompt}]
    else:
        body["prompt"] = req.prompt
    if req.salt is not None:
        body["cache_salt"] = req.salt
    url = f"{base_url}/v1/{'chat/completions' if api == 'chat' else 'completions'}"
    start = time.perf_counter()
    res.start = start - t0
    last: float | None = None
    chunks = 0
    finish_reason: str | None = None
    try:
        headers = {**req.headers, **({"Authorization": f"Bearer {req.api_key}"} if req.api_key else {})}
        async with client.stream("POST", url, json=body, headers=headers or None) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[5:].strip()
                if data == "[DONE]":
                    break
                event = json.loads(data)
                now = time.perf_counter()
                if event.get("error"):  # a failure after the 200 status line: the request did not succeed
                    err = event["error"]
                    res.error = f"error event: {err.get('message', err) if isinstance(err, dict) else err}"
                    return res
                for choice in event.get("choices") or []:
                    text = choice.get("text") if api != "chat" else (choice.get("delta") or {}).get("content")
                    if text:
                        chunks += 1
                        if last is None:
                            res.ttft = now - start
                        else:
                            res.itls.append(now - last)
                        last = now
                    finish_reason = choice.get("finish_reason") or finish_reason
                usage = event.get("usage")
                if usage:
                    res.prompt_tokens = usage.get("prompt_tokens")
                    res.completion_tokens = usage.get("completion_tokens")
                    details = usage.get("prompt_tokens_details") or {}
                    res.cached_tokens = details.get("cached_tokens")
        res.e2e = time.perf_counter() - start
        if res.completion_tokens is None:  # no usage chunk: one chunk per token is the usual streaming shape
            res.completion_tokens = chunks
        # A complete stream says why it ended. Without a finish_reason the server cut it short (llama-cpp-python
        # does so by default when another request waits): counting it as done would inflate throughput.
        if finish_reason is None:
            res.error = f"stream ended without a finish_reason after {chunks} chunks"
            return res
        res.ok = True
    except (httpx.HTTPError, json.JSONDecodeError) as exc:
        res.error = f"{type(exc).__name__}: {exc}"
    return res


async def run_workload(
    base_url: str,
    workload: Workload,
    *,
    model: str | None = None,
    server: str = "",
    api: str = "completions",
    time_limit_s: float = 600.0,
    request_timeout_s: float = 300.0,
    progress: bool = True,
    api_key: str | None = None,
) -> WorkloadResult:
    """Send the workload's requests in order, wave by wave, at most the wave's concurrency in flight; none
    starts after `time_limit_s` (those are left out of the result). `api_key`: the operator's key, for
    /v1/models, /metrics and requests that carry no key of their own."""
    base_url = base_url.rstrip("/")
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else None
    api = workload.api or api
    async with httpx.AsyncClient(timeout=request_timeout_s, headers=headers) as client:
        if model is None:
            model = (await client.get(f"{base_url}/v1/models")).json()["data"][0]["id"]
        before = await read_cache_counters(client, base_url)
        waves = sorted({r.wave for r in workload.requests})
        sems = {w: asyncio.Semaphore(workload.wave_concurrency.get(w, workload.concurrency)) for w in waves}
        peak: list[float] = []
        done = asyncio.Event()

        async def sample() -> None:
            while not done.is_set():
                usage = (await read_gauges(client, base_url)).get("brine_kv_cache_usage_perc")
                if usage is not None:
                    peak.append(usage)
                with contextlib.suppress(asyncio.TimeoutError):
                    await asyncio.wait_for(done.wait(), 0.2)

        sampler = asyncio.ensure_future(sample()) if workload.sample_kv else None
        t0 = time.perf_counter()
        total = len(workload.baseline) + len(workload.requests)
        bar = tqdm(total=total, desc=f"{server or base_url} {workload.name}", disable=not progress)

        async def one(req: BenchRequest) -> RequestResult | None:
            async with sems[req.wave]:  # acquired in submission order, so sequential waves keep their order
                if time.perf_counter() - t0 > time_limit_s:
                    return None
                res = await send(client, base_url, model, req, api, t0)
                bar.update(1)
                return res

        # noisy-neighbour: the baseline alone first, then the measured requests beside the noisy tenant.
        results: list[RequestResult | None] = list(await asyncio.gather(*(one(r) for r in workload.baseline)))
        noise = Noise(client, base_url, model, workload.noise) if workload.noise else None
        if noise is not None:
            await noise.start()
        try:
            for w in waves:
                results += await asyncio.gather(*(one(r) for r in workload.requests if r.wave == w))
        finally:
            if noise is not None:
                await noise.stop()
        duration = time.perf_counter() - t0
        bar.close()
        done.set()
        if sampler is not None:
            await sampler
        gauges = await read_gauges(client, base_url) if workload.sample_kv else {}
        after = await read_cache_counters(client, base_url)
    out = WorkloadResult(workload.name, server, workload.params, workload.concurrency, duration,
                         [r for r in results if r is not None])  # fmt: skip
    if noise is not None:
        out.noise_sent, out.noise_ok = noise.sent, noise.ok
    if before is not None and after is not None:
        out.cache_queries, out.cache_hits = after[0] - before[0], after[1] - before[1]
    if peak:
        out.kv_usage_peak = max(peak)
    out.cached_blocks_end = gauges.get("brine_num_cached_blocks")
    return out


class Noise:
    """A noisy tenant: sends one `body` to /v1/completions after another until stopped (then its request in
    flight is cancelled, which a server sees as a disconnect)."""

    def __init__(self, client: httpx.AsyncClient, base_url: str, model: str, body: dict) -> None:
        self._client, self._url = client, f"{base_url}/v1/completions"
        self._body = {"model": model, **body}
        self._task: asyncio.Task | None = None
        self.sent = self.ok = 0

    async def start(self) -> None:
        self._task = asyncio.ensure_future(self._loop())
        await asyncio.sleep(0.5)  # let the first one reach the server before the measured requests

    async def _loop(self) -> None:
        while True:
            self.sent += 1
            try:
                r = await self._client.post(self._url, json=self._body)
                self.ok += r.status_code == 200
                if r.status_code != 200:
                    await asyncio.sleep(0.5)  # a server that refuses it: keep asking, not in a hot loop
            except httpx.HTTPError:
                await asyncio.sleep(0.5)

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default="http://127.0.0.1:8000")
    p.add_argument(
        "--workload",
        choices=[*WORKLOADS, "prefix-sweep", "noisy-neighbour", *TENANT_WORKLOADS],
        default="doc-qa",
    )
    p.add_argument("--api-key", default=None, help="the operator's key (for /metrics and /v1/models)")
    p.add_argument(
        "--write-server-files",
        default=None,
        metavar="DIR",
        help="for a tenants workload: write its --tenants and --public-prefix files (for --seed) and exit",
    )
    p.add_argument("--model", default=None, help="default: the first id at /v1/models")
    p.add_argument("--api", choices=["completions", "chat"], default="completions")
    p.add_argument("--seed", type=int, default=None, help="default: random (a cold start on a warm server)")
    p.add_argument(
        "--time-limit", type=float, default=600.0, help="no request starts after this many seconds"
    )
    p.add_argument(
        "--size", action="append", default=[], metavar="NAME=INT", help="e.g. --size doc_tokens=500"
    )
    p.add_argument("--out", default=None, help="write the result as JSON here")
    args = p.parse_args(argv)
    seed = args.seed if args.seed is not None else random.randrange(1 << 30)
    sizes = {k: int(v) for k, v in (s.split("=", 1) for s in args.size)}
    workload = build(args.workload, seed, **sizes)
    if args.write_server_files:
        from pathlib import Path

        tenants, prefix = write_server_files(workload, Path(args.write_server_files))
        print(
            f"seed {seed}: brine serve --tenants {tenants}"
            + (f" [--public-prefix {prefix}]" if prefix else "")
        )
        return
    result = asyncio.run(run_workload(args.base_url, workload, model=args.model, api=args.api,
                                      time_limit_s=args.time_limit, api_key=args.api_key))  # fmt: skip
    from benchmarks.report import summarize

    print(json.dumps({"seed": seed, **summarize(result)}, indent=2))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"seed": seed, **to_json(result)}, f, indent=2)


if __name__ == "__main__":
    main()
