"""Where a flooded victim's first token waits (issue 28 section 4), in process, without HTTP.

An `AsyncEngine` on the default model runs `--streams` greedy 400-token streams under salt "a"; a 5-token
victim under salt "b" arrives `--victims` times at random moments. Every engine step is timed, so each
victim's wait, where it was not served in an express pass inside the step in flight (engine.express), splits
into: the rest of the step in flight when it arrived, the gap until its own step starts (the inbox is read
between steps), its own step, and the hand-over to its caller. Also the flood's tokens per second alone and
while the victims run, to weigh a change to step sizes (`--max-num-seqs`) or the express lane. Figures only.

    python -m benchmarks.salt_flood_breakdown_bench [--streams 80] [--victims 15] [--max-num-seqs 64]
        [--no-express-lane]
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import json
import os
import random
import statistics
import time

from benchmarks.salt_flood_bench import VICTIM_PROMPT
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.request import Origin
from engine.sampling_params import SamplingParams
from kv_cache.namespace import CacheNamespace


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=80)
    parser.add_argument("--victims", type=int, default=15)
    parser.add_argument("--max-num-seqs", type=int, default=64)
    parser.add_argument("--no-express-lane", action="store_true", help="as brine serve's flag")
    args = parser.parse_args()
    config = EngineConfig(max_num_seqs=args.max_num_seqs, express_lane=not args.no_express_lane)
    engine = AsyncEngine.from_config(config)
    core = engine._core
    steps: list[tuple[float, float]] = []
    step = core.step

    def timed(*args: object) -> list[RequestOutput]:
        start = time.perf_counter()
        outputs = step(*args)  # type: ignore[arg-type]
        steps.append((start, time.perf_counter()))
        return outputs

    core.step = timed  # type: ignore[method-assign]
    flood_tokens = [0]
    alone = [0.0]

    async def flood(i: int) -> None:
        params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
        while True:
            prompt = [*VICTIM_PROMPT[:4], 100 + i % 50]
            async for out in engine.generate(prompt, params, origin=Origin(CacheNamespace(salt="a"))):
                flood_tokens[0] += len(out.outputs[0].token_ids)

    async def victim() -> tuple[float, float]:
        params = SamplingParams(max_tokens=1, temperature=0)
        start = time.perf_counter()
        async for _ in engine.generate(VICTIM_PROMPT, params, origin=Origin(CacheNamespace(salt="b"))):
            break
        return start, time.perf_counter()

    async def run() -> tuple[list[float], list[tuple[float, float]], float]:
        for _ in range(3):
            await victim()
        idle = []
        for _ in range(9):
            start, end = await victim()
            idle.append(end - start)
        tasks = [asyncio.create_task(flood(i)) for i in range(args.streams)]
        await asyncio.sleep(10)  # the flood admitted and decoding
        tokens, t0 = flood_tokens[0], time.perf_counter()
        await asyncio.sleep(5)
        alone[0] = (flood_tokens[0] - tokens) / (time.perf_counter() - t0)  # no victim beside it
        tokens, t0 = flood_tokens[0], time.perf_counter()
        rows = []
        for _ in range(args.victims):
            await asyncio.sleep(random.uniform(0.05, 0.3))
            rows.append(await victim())
        rate = (flood_tokens[0] - tokens) / (time.perf_counter() - t0)
        for task in tasks:
            task.cancel()
        return idle, rows, rate

    idle, rows, rate = asyncio.run(run())
    parts: dict[str, list[float]] = {
        k: [] for k in ("ttft", "step_in_flight", "gap", "own_step", "hand_over")
    }
    for start, end in rows:
        parts["ttft"].append(end - start)
        in_flight = next((s for s in steps if s[0] <= start < s[1]), None)
        own = next((s for s in steps if s[0] >= start), None)
        if own is None or own[0] > end:  # served in an express pass inside the step in flight: no parts
            continue
        parts["step_in_flight"].append(in_flight[1] - start if in_flight else 0.0)
        parts["gap"].append(own[0] - (in_flight[1] if in_flight else start))
        parts["own_step"].append(own[1] - own[0])
        parts["hand_over"].append(end - own[1])
    idle_ms = statistics.median(idle) * 1e3
    report: dict[str, object] = {
        "max_num_seqs": args.max_num_seqs,
        "load_average": round(os.getloadavg()[0], 2),
        "idle_ttft_ms": round(idle_ms, 1),
        **{f"{k}_median_ms": round(statistics.median(v) * 1e3, 1) for k, v in parts.items() if v},
        "victims_served_inside_a_step": len(rows) - len(parts["own_step"]),
        "ratio": round(statistics.median(parts["ttft"]) * 1e3 / idle_ms, 2),
        "step_median_ms": round(statistics.median((e - s) * 1e3 for s, e in steps[-300:]), 1),
        "express_lane": not args.no_express_lane,
        "flood_alone_tokens_per_s": round(alone[0], 1),
        "flood_tokens_per_s": round(rate, 1),
    }
    print(json.dumps(report, indent=2))
    os._exit(0)  # the flood's tasks and the engine thread: nothing to wait for


if __name__ == "__main__":
    main()
