"""KV tiers and retention, measured in process against the same engine without them (issue 31's workloads):

- restart: TTFT of a ~2,000-token document after a restart with `--kv-disk-dir`, against its cold TTFT;
- working-set: 20 documents of ~1,000 tokens, questions cycling through them, a pool that holds 5: hit ratio
  and req/s without a tier, with the host tier and with the disk tier;
- retention: a small pool, a retained document and an unretained one, then a flood of unrelated prompts: the
  cached tokens of each asked again;
- unique: prompts that share nothing (the tier cannot help, only cost: every block is written), throughput
  with the disk tier over without, runs alternated.

    .venv/bin/python -m benchmarks.kv_tier_bench [--scenario all|restart|working-set|retention|unique]
        [--repeats 3] [--doc-tokens 1000] [--flood 12] [--unique-requests 8] [--out FILE.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams

ONE = SamplingParams(max_tokens=1, temperature=0.0)
ANSWER = SamplingParams(max_tokens=8, temperature=0.0)


def tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(300, 40000) for _ in range(n)]


def engine(**kw: Any) -> AsyncEngine:
    return AsyncEngine.from_config(EngineConfig(device="cpu", **kw))


async def ask(eng: AsyncEngine, ids: list[int], params: SamplingParams = ONE) -> tuple[float, int]:
    """(TTFT seconds, cached tokens)."""
    t0 = time.perf_counter()
    ttft, cached = None, 0
    async for out in eng.generate(ids, params):
        if ttft is None and any(c.token_ids for c in out.outputs):
            ttft = time.perf_counter() - t0
        cached = out.num_cached_tokens
    return ttft or time.perf_counter() - t0, cached


async def settle(eng: AsyncEngine) -> None:
    while eng.num_used_blocks():
        await asyncio.sleep(0.01)


async def restart(repeats: int) -> dict[str, Any]:
    doc = tokens(1, 2000)
    cold, warm = [], []
    for _ in range(repeats):
        with tempfile.TemporaryDirectory() as d:
            first = engine(num_blocks=512, kv_disk_dir=d)
            await ask(first, tokens(99, 32))  # warm the process up
            t, _ = await ask(first, doc)
            cold.append(t)
            await settle(first)
            first.shutdown()
            second = engine(num_blocks=512, kv_disk_dir=d)
            await ask(second, tokens(98, 32))
            t, cached = await ask(second, doc)
            assert cached >= 1984, cached
            warm.append(t)
            second.shutdown()
    c, w = statistics.median(cold), statistics.median(warm)
    return {"cold_ttft_s": c, "restart_ttft_s": w, "ratio": w / c, "runs": repeats}


async def working_set(rounds: int, doc_tokens: int) -> dict[str, Any]:
    docs = [tokens(100 + i, doc_tokens) for i in range(20)]
    doc_blocks = -(-(doc_tokens + 24 + 8) // 16)
    results: dict[str, Any] = {}
    for name, kw in (("none", {}), ("host", {"kv_host_memory": 1 << 30}), ("disk", {"kv_disk_dir": None})):
        with tempfile.TemporaryDirectory() as d:
            if "kv_disk_dir" in kw:
                kw = {"kv_disk_dir": d}
            eng = engine(num_blocks=5 * doc_blocks + 8, **kw)  # 5 documents (question and answer too)
            await ask(eng, tokens(99, 32))
            for i, doc in enumerate(docs):  # first pass: every document computed once
                await ask(eng, doc + tokens(1000 + i, 24), ANSWER)
            t0 = time.perf_counter()
            queried = hit = 0
            n = 0
            for r in range(rounds):
                for i, doc in enumerate(docs):
                    prompt = doc + tokens(2000 + 100 * r + i, 24)
                    _, cached = await ask(eng, prompt, ANSWER)
                    queried += len(prompt)
                    hit += cached
                    n += 1
            elapsed = time.perf_counter() - t0
            await settle(eng)
            eng.shutdown()
        results[name] = {"hit_ratio": hit / queried, "req_per_s": n / elapsed}
    return results


async def retention(flood: int) -> dict[str, Any]:
    eng = engine(num_blocks=160)  # 2,560 tokens
    await ask(eng, tokens(99, 32))
    kept, plain = tokens(7, 500), tokens(8, 500)
    retained = SamplingParams(max_tokens=1, temperature=0.0, retention_s=3600)
    await ask(eng, kept, retained)
    await ask(eng, plain)
    for i in range(flood):  # a flood of unrelated prompts (12: 6x the pool)
        await ask(eng, tokens(500 + i, 1200))
    _, kept_cached = await ask(eng, kept)
    _, plain_cached = await ask(eng, plain)
    eng.shutdown()  # (retained blocks stay in use until their TTL: no settle here)
    return {
        "retained_cached_tokens": kept_cached,
        "unretained_cached_tokens": plain_cached,
        "prompt_tokens": 500,
    }


async def unique(requests: int, rounds: int) -> dict[str, Any]:
    """Prompts sharing nothing, with the disk tier and without, the order alternated each round. `drained`
    times a run until the tier's writer has also finished that run's blocks (what a steady stream of such
    requests pays); `served` stops at the last answer (the writer finishing while nothing else runs)."""
    served: list[float] = []
    drained: list[float] = []
    seed = 10_000
    with tempfile.TemporaryDirectory() as d:
        engines = {"none": engine(num_blocks=512), "disk": engine(num_blocks=512, kv_disk_dir=d)}
        for eng in engines.values():
            await ask(eng, tokens(99, 32))
            await settle(eng)
        for r in range(rounds):
            rate: dict[str, tuple[float, float]] = {}
            for name in ["none", "disk"] if r % 2 == 0 else ["disk", "none"]:
                eng = engines[name]
                prompts = [tokens(seed + i, 500) for i in range(requests)]
                seed += requests
                t0 = time.perf_counter()
                await asyncio.gather(*(ask(eng, p, ANSWER) for p in prompts))
                t_served = time.perf_counter() - t0
                while eng.tier_work_pending():
                    await asyncio.sleep(0.002)
                rate[name] = (requests / t_served, requests / (time.perf_counter() - t0))
                await settle(eng)
            served.append(rate["disk"][0] / rate["none"][0])
            drained.append(rate["disk"][1] / rate["none"][1])
        for eng in engines.values():
            eng.shutdown()
    return {
        "disk_over_none_served": statistics.median(served),
        "disk_over_none_drained": statistics.median(drained),
        "served": served,
        "drained": drained,
    }


async def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument(
        "--scenario", default="all", choices=["all", "restart", "working-set", "retention", "unique"]
    )
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--out", type=Path, default=None)
    p.add_argument("--doc-tokens", type=int, default=1000, help="working-set documents' length")
    p.add_argument("--flood", type=int, default=12, help="retention: unrelated 1,200-token prompts")
    p.add_argument("--unique-requests", type=int, default=8)
    args = p.parse_args()
    out: dict[str, Any] = {}
    if args.scenario in ("all", "restart"):
        out["restart"] = await restart(args.repeats)
        print("restart", out["restart"], flush=True)
    if args.scenario in ("all", "working-set"):
        out["working_set"] = await working_set(1, args.doc_tokens)
        print("working-set", out["working_set"], flush=True)
    if args.scenario in ("all", "retention"):
        out["retention"] = await retention(args.flood)
        print("retention", out["retention"], flush=True)
    if args.scenario in ("all", "unique"):
        out["unique"] = await unique(args.unique_requests, args.repeats)
        print("unique", out["unique"], flush=True)
    if args.out is not None:
        args.out.write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    asyncio.run(main())
