"""What the express lane (engine.express) costs a flood and gives a small owner beside it, in process.

An `AsyncEngine` on the default model runs `--streams` greedy 400-token streams under salt "a". In alternating
rounds of `--seconds` each, it measures the flood's tokens per second alone, then beside a victim under salt
"b" that streams 100-token answers back to back, and the victim's inter-token gaps. Run it once with the lane
and once with `--no-express-lane` (same machine, one after the other) to weigh one against the other: with the
lane a small owner's tokens come at about twice its idle pace and the flood gives up to half of its time
while one decodes; without, the small owner decodes at the flood's pace. Figures only.

`--pause-cost`: instead, the cost of the pauses themselves when nobody waits: an `EngineCore` with 64 decoding
sequences, steps with a pause that has nothing to run against steps that run straight through, alternated.
`--beside-prefill`: a victim's first token when it arrives `--delay` s into another salt's cold
`--prompt-tokens`-token prompt (one long step), against its first token alone.

    python -m benchmarks.express_lane_bench [--no-express-lane] [--streams 80] [--rounds 3] [--seconds 4]
    python -m benchmarks.express_lane_bench --pause-cost
    python -m benchmarks.express_lane_bench --beside-prefill [--no-express-lane] [--prompt-tokens 2048]
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
import statistics
import time

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.outputs import RequestOutput
from engine.request import Origin
from engine.sampling_params import SamplingParams
from kv_cache.namespace import CacheNamespace

FLOOD = Origin(CacheNamespace(salt="a"))
VICTIM = Origin(CacheNamespace(salt="b"))
VICTIM_PROMPT = [504, 3458, 282, 4649, 314]


def flood_and_victim(args: argparse.Namespace) -> dict[str, object]:
    engine = AsyncEngine.from_config(EngineConfig(max_num_seqs=64, express_lane=not args.no_express_lane))
    flood_tokens = [0]
    gaps: list[float] = []

    async def flood(i: int) -> None:
        params = SamplingParams(max_tokens=400, ignore_eos=True, temperature=0)
        while True:
            async for out in engine.generate([*VICTIM_PROMPT[:4], 100 + i % 50], params, origin=FLOOD):
                flood_tokens[0] += len(out.outputs[0].token_ids)

    async def victim(stop: asyncio.Event) -> None:
        params = SamplingParams(max_tokens=100, ignore_eos=True, temperature=0)
        while not stop.is_set():
            last = None
            async for _ in engine.generate(VICTIM_PROMPT, params, origin=VICTIM):
                now = time.perf_counter()
                if last is not None:
                    gaps.append(now - last)
                last = now

    async def run() -> dict[str, list[float]]:
        tasks = [asyncio.create_task(flood(i)) for i in range(args.streams)]
        await asyncio.sleep(10)  # admitted and decoding
        rates: dict[str, list[float]] = {"alone": [], "beside_victim": []}
        for _ in range(args.rounds):
            for kind in rates:
                stop = asyncio.Event()
                beside = asyncio.create_task(victim(stop)) if kind == "beside_victim" else None
                await asyncio.sleep(0.5)
                t0, f0 = time.perf_counter(), flood_tokens[0]
                await asyncio.sleep(args.seconds)
                rates[kind].append((flood_tokens[0] - f0) / (time.perf_counter() - t0))
                stop.set()
                if beside is not None:
                    await beside
        for task in tasks:
            task.cancel()
        return rates

    rates = asyncio.run(run())
    alone, beside = statistics.median(rates["alone"]), statistics.median(rates["beside_victim"])
    return {
        "express_lane": not args.no_express_lane,
        "flood_tokens_per_s_alone": [round(x, 1) for x in rates["alone"]],
        "flood_tokens_per_s_beside_victim": [round(x, 1) for x in rates["beside_victim"]],
        "flood_beside_over_alone": round(beside / alone, 2),
        "victim_itl_median_ms": round(statistics.median(gaps) * 1e3, 1),
    }


def beside_prefill(args: argparse.Namespace) -> dict[str, object]:
    """A victim's TTFT when it arrives `--delay` s into a cold `--prompt-tokens` prompt of another salt (one
    step of that many tokens, or the first chunk of it), against its TTFT alone; rounds alternated."""
    config = EngineConfig(
        max_num_batched_tokens=max(2048, args.prompt_tokens), express_lane=not args.no_express_lane
    )
    engine = AsyncEngine.from_config(config)
    one = SamplingParams(max_tokens=1, temperature=0)

    async def first_token(tokens: list[int], origin: Origin) -> float:
        start = time.perf_counter()
        async for _ in engine.generate(tokens, one, origin=origin):
            break
        return time.perf_counter() - start

    async def run() -> tuple[list[float], list[float], list[float]]:
        idle, beside, long = [], [], []
        for _ in range(2):
            await first_token(VICTIM_PROMPT, VICTIM)
        for r in range(args.rounds):
            idle.append(await first_token(VICTIM_PROMPT, VICTIM))
            doc = [(7 * i + 13 * r) % 40_000 + 100 for i in range(args.prompt_tokens)]  # cold every round
            task = asyncio.create_task(first_token(doc, FLOOD))
            await asyncio.sleep(args.delay)
            beside.append(await first_token(VICTIM_PROMPT, VICTIM))
            long.append(await task)
        return idle, beside, long

    idle, beside, long = asyncio.run(run())
    return {
        "express_lane": not args.no_express_lane,
        "prompt_tokens": args.prompt_tokens,
        "victim_ttft_idle_ms": round(statistics.median(idle) * 1e3, 1),
        "victim_ttft_beside_prefill_ms": [round(x * 1e3, 1) for x in beside],
        "long_prompt_ttft_ms": [round(x * 1e3, 1) for x in long],
    }


def pause_cost(args: argparse.Namespace) -> dict[str, object]:
    from engine.engine_core import EngineCore
    from engine.model.loading.files import resolve_model
    from engine.model_runner import ModelRunner
    from engine.threads import set_torch_threads
    from engine.tokenizer import Tokenizer

    set_torch_threads(None)
    files = resolve_model(None)
    config = EngineConfig(model=str(files.path), max_num_seqs=64)
    core = EngineCore(ModelRunner(config), Tokenizer(files.path), config)

    class Nothing:  # a pause at which nobody arrived
        def poll(self) -> None:
            pass

        def emit(self, outputs: list[RequestOutput]) -> None:
            pass

    params = SamplingParams(max_tokens=4000, ignore_eos=True, temperature=0)
    for i in range(64):
        core.add_request(f"f{i}", [1, 504, 3458, 100 + i], params, origin=FLOOD)
    for _ in range(5):
        core.step()
    ms: dict[str, list[float]] = {"pausing": [], "straight": []}
    for _ in range(args.rounds * 4):
        for kind in ms:
            t0 = time.perf_counter()
            for _ in range(5):
                core.step(Nothing() if kind == "pausing" else None)
            ms[kind].append((time.perf_counter() - t0) / 5 * 1e3)
    pausing, straight = statistics.median(ms["pausing"]), statistics.median(ms["straight"])
    return {
        "step_ms_pausing": round(pausing, 2),
        "step_ms_straight": round(straight, 2),
        "pausing_over_straight": round(pausing / straight, 3),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--no-express-lane", action="store_true")
    parser.add_argument("--pause-cost", action="store_true")
    parser.add_argument("--beside-prefill", action="store_true")
    parser.add_argument("--prompt-tokens", type=int, default=2048)
    parser.add_argument("--delay", type=float, default=0.5)
    parser.add_argument("--streams", type=int, default=80)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--seconds", type=float, default=4.0)
    args = parser.parse_args()
    if args.pause_cost:
        report = pause_cost(args)
    elif args.beside_prefill:
        report = beside_prefill(args)
    else:
        report = flood_and_victim(args)
    report["load_average"] = round(os.getloadavg()[0], 2)
    print(json.dumps(report, indent=2))
    os._exit(0)  # the flood's tasks and the engine thread: nothing to wait for


if __name__ == "__main__":
    main()
