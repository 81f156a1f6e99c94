"""Decode throughput at several concurrency levels, side by side in one run (these machines are noisy).

For each level c, c requests with distinct prompts generate `--max-tokens` tokens each (ignore_eos, greedy).
Decode throughput counts the tokens generated after every request has its first token (so prefill is left
out) over the time from then to the last token. The ratio to single-stream is what batching buys.

    .venv/bin/python benchmarks/decode_bench.py                       # default model, 1 / 4 / 16
    .venv/bin/python benchmarks/decode_bench.py --concurrency 1,8,32 --max-tokens 256 --device cuda
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time
from dataclasses import dataclass

from engine.async_engine import AsyncEngine, EngineConfig
from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class LevelResult:
    concurrency: int
    decode_tokens_per_s: float
    mean_itl_ms: float  # per-stream inter-token latency
    ttft_ms: float  # mean time to first token (includes queueing behind the other prefills)


async def one_request(engine: AsyncEngine, ids: list[int], params: SamplingParams) -> list[float]:
    """Arrival times of every generated token."""
    times: list[float] = []
    async for out in engine.generate(ids, params):
        now = time.perf_counter()
        times += [now] * sum(len(c.token_ids) for c in out.outputs)
    return times


async def run_level(engine: AsyncEngine, concurrency: int, prompt_len: int, max_tokens: int) -> LevelResult:
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    vocab = 1000
    # Distinct prompts (first token differs) so that the prefix cache does not share their blocks.
    prompts = [[(i * 7919 + j * 31) % vocab + 100 for j in range(prompt_len)] for i in range(concurrency)]
    start = time.perf_counter()
    all_times = await asyncio.gather(*(one_request(engine, p, params) for p in prompts))
    decode_start = max(t[0] for t in all_times)
    end = max(t[-1] for t in all_times)
    decode_tokens = sum(1 for times in all_times for t in times if t > decode_start)
    itls = [(t[-1] - t[0]) / (len(t) - 1) for t in all_times if len(t) > 1]
    return LevelResult(
        concurrency=concurrency,
        decode_tokens_per_s=decode_tokens / (end - decode_start) if end > decode_start else float("nan"),
        mean_itl_ms=1000 * statistics.mean(itls),
        ttft_ms=1000 * statistics.mean(t[0] - start for t in all_times),
    )


async def main_async(args: argparse.Namespace) -> list[LevelResult]:
    levels = [int(c) for c in args.concurrency.split(",")]
    config = EngineConfig(
        model=args.model,
        device=args.device,
        dtype=args.dtype,
        num_blocks=args.num_blocks,
        max_num_seqs=max(levels),
        enable_prefix_caching=False,  # measure decode, not cache hits
    )
    t0 = time.perf_counter()
    engine = AsyncEngine.from_config(config)
    print(f"loaded {engine.model_name} in {time.perf_counter() - t0:.1f}s")
    try:
        await run_level(engine, 2, args.prompt_len, 8)  # warm-up (lazy init, allocator, caches)
        results = []
        for level in levels:
            results.append(await run_level(engine, level, args.prompt_len, args.max_tokens))
            assert engine.num_used_blocks() == 0
        return results
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default=None, help="default: the embedded SmolLM2-135M-Instruct")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--concurrency", default="1,4,16")
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--num-blocks", type=int, default=512)
    args = parser.parse_args()
    results = asyncio.run(main_async(args))
    base = results[0].decode_tokens_per_s
    print(f"\n{'concurrency':>11} {'decode tok/s':>13} {'vs first':>9} {'ITL ms':>8} {'TTFT ms':>8}")
    for r in results:
        print(
            f"{r.concurrency:>11} {r.decode_tokens_per_s:>13.1f} {r.decode_tokens_per_s / base:>8.2f}x "
            f"{r.mean_itl_ms:>8.1f} {r.ttft_ms:>8.1f}"
        )


if __name__ == "__main__":
    main()
