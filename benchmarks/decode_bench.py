"""Decode throughput at several concurrency levels, side by side in one run (these machines are noisy).

For each level c, c requests with distinct prompts generate `--max-tokens` tokens each (ignore_eos; greedy
unless `--temperature` / `--top-p` / `--repetition-penalty` / `--seeded` ask for sampling, whose cost the
greedy figures leave out).
Decode throughput counts the tokens generated after every request has its first token (so prefill is left
out) over the time from then to the last token. The ratio to single-stream is what batching buys.

`--baseline DIR` measures another checkout against this one (before / after a change): each round runs the
benchmark once on each tree, in separate processes, alternating which goes first; it reports medians over
rounds and the paired per-round ratio, with its spread (noise on a shared machine moves both of a pair).

    .venv/bin/python benchmarks/decode_bench.py                       # default model, 1 / 4 / 16
    .venv/bin/python benchmarks/decode_bench.py --concurrency 1,8,32 --max-tokens 256 --device cuda
    git archive HEAD~1 | tar -x -C /tmp/before
    .venv/bin/python benchmarks/decode_bench.py --baseline /tmp/before --rounds 5
    .venv/bin/python benchmarks/decode_bench.py --json-schema --concurrency 1,16   # constrained vs free
    .venv/bin/python benchmarks/decode_bench.py --temperature 0.8 --top-p 0.9 --baseline /tmp/before

`--json-schema` runs every level twice in one engine, free and with every request constrained to a JSON
schema (an object holding one string of at least 4096 characters, so the grammar stays live for all
`--max-tokens`), alternating
which goes first over `--rounds`, and reports the medians and the constrained / free ratio.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputSpec

# One string field longer than any run fills: the grammar stays live, so the mask applies at every step.
BENCH_SCHEMA = StructuredOutputSpec(
    "json_schema",
    json.dumps(
        {
            "type": "object",
            "properties": {"story": {"type": "string", "minLength": 4096}},
            "required": ["story"],
        }
    ),
)


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


async def run_level(
    engine: AsyncEngine,
    concurrency: int,
    prompt_len: int,
    max_tokens: int,
    structured: StructuredOutputSpec | None = None,
    sampling: dict | None = None,
) -> LevelResult:
    # `structured` only when set: a --baseline tree may predate the field.
    extra = {} if structured is None else {"structured": structured}
    sampling = sampling or {"temperature": 0.0}
    seeded = sampling.pop("seeded", False)
    vocab = 1000
    # Distinct prompts (first token differs) so that the prefix cache does not share their blocks.
    prompts = [[(i * 7919 + j * 31) % vocab + 100 for j in range(prompt_len)] for i in range(concurrency)]
    params = [
        SamplingParams(
            max_tokens=max_tokens, ignore_eos=True, seed=i if seeded else None, **sampling, **extra
        )
        for i in range(concurrency)
    ]
    start = time.perf_counter()
    all_times = await asyncio.gather(
        *(one_request(engine, p, q) for p, q in zip(prompts, params, strict=True))
    )
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
        **({} if args.batch_invariant else {"batch_invariant": False}),  # a --baseline tree may predate it
        **({} if args.quantization == "auto" else {"quantization": args.quantization}),  # and this
    )
    t0 = time.perf_counter()
    engine = AsyncEngine.from_config(config)
    print(f"loaded {engine.model_name} in {time.perf_counter() - t0:.1f}s")
    try:
        await run_level(engine, 2, args.prompt_len, 8)  # warm-up (lazy init, allocator, caches)
        if args.json_schema:
            return await _constrained_vs_free(engine, args, levels)
        results = []
        sampling = {
            "temperature": args.temperature,
            "top_p": args.top_p,
            "repetition_penalty": args.repetition_penalty,
            "seeded": args.seeded,
        }
        for level in levels:
            results.append(
                await run_level(engine, level, args.prompt_len, args.max_tokens, None, dict(sampling))
            )
            assert engine.num_used_blocks() == 0
        return results
    finally:
        engine.shutdown()


async def _constrained_vs_free(
    engine: AsyncEngine, args: argparse.Namespace, levels: list[int]
) -> list[LevelResult]:
    """Per level: free and constrained runs alternating over rounds; prints the ratio table."""
    await run_level(engine, 2, args.prompt_len, 8, BENCH_SCHEMA)  # compiles the grammar once (cached)
    print(f"\n{'concurrency':>11} {'free tok/s':>11} {'json tok/s':>11} {'ratio':>6} {'min-max':>12}")
    out = []
    for level in levels:
        free: list[float] = []
        constrained: list[float] = []
        for i in range(args.rounds):
            for spec in (None, BENCH_SCHEMA) if i % 2 == 0 else (BENCH_SCHEMA, None):
                r = await run_level(engine, level, args.prompt_len, args.max_tokens, spec)
                (free if spec is None else constrained).append(r.decode_tokens_per_s)
                out.append(r)
        ratios = [c / f for c, f in zip(constrained, free, strict=True)]
        print(
            f"{level:>11} {statistics.median(free):>11.1f} {statistics.median(constrained):>11.1f} "
            f"{statistics.median(ratios):>5.2f}x {min(ratios):>5.2f}-{max(ratios):.2f}"
        )
    return out


def _run_tree(tree: Path, argv: list[str]) -> list[LevelResult]:
    """This benchmark in a fresh process whose `engine` package comes from `tree`."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    cmd = [sys.executable, __file__, *argv, "--json"]
    done = subprocess.run(cmd, env=env, check=True, capture_output=True, text=True)
    return [LevelResult(**r) for r in json.loads(done.stdout.strip().splitlines()[-1])]


def compare(baseline: Path, rounds: int, argv: list[str]) -> None:
    """Paired rounds of baseline vs this checkout; prints medians and per-round ratios."""
    ours = Path(__file__).resolve().parent.parent
    runs: dict[str, list[list[LevelResult]]] = {"before": [], "after": []}
    for i in range(rounds):
        order = [("before", baseline), ("after", ours)]
        for name, tree in order if i % 2 == 0 else order[::-1]:
            runs[name].append(_run_tree(tree, argv))
            print(
                f"round {i + 1} {name}: " + ", ".join(f"{r.decode_tokens_per_s:.1f}" for r in runs[name][-1])
            )
    print(f"\nbefore {baseline}  after {ours}  ({rounds} rounds, medians; ratio = after / before per round)")
    print(f"{'concurrency':>11} {'before tok/s':>13} {'after tok/s':>12} {'ratio':>6} {'min-max':>12}")
    for j, level in enumerate(runs["after"][0]):
        before = [r[j].decode_tokens_per_s for r in runs["before"]]
        after = [r[j].decode_tokens_per_s for r in runs["after"]]
        ratios = [a / b for a, b in zip(after, before, strict=True)]
        print(
            f"{level.concurrency:>11} {statistics.median(before):>13.1f} {statistics.median(after):>12.1f} "
            f"{statistics.median(ratios):>5.2f}x {min(ratios):>5.2f}-{max(ratios):.2f}"
        )


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
    parser.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's default)")
    parser.add_argument(
        "--batch-invariant",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="--no-batch-invariant measures the escape hatch's kernels (SDPA, unpadded matmuls)",
    )
    parser.add_argument(
        "--quantization",
        choices=("auto", "none"),
        default="auto",
        help="none: the GGUF's weights dequantized to --dtype, as before the quantized kernel",
    )
    parser.add_argument("--temperature", type=float, default=0.0, help="0: greedy (the default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--repetition-penalty", type=float, default=1.0)
    parser.add_argument("--seeded", action="store_true", help="every request with its own seed")
    parser.add_argument("--baseline", type=Path, help="another checkout to compare against, side by side")
    parser.add_argument("--rounds", type=int, default=3, help="paired rounds with --baseline")
    parser.add_argument(
        "--json-schema",
        action="store_true",
        help="measure JSON-schema-constrained decode against free decode",
    )
    parser.add_argument("--json", action="store_true", help=argparse.SUPPRESS)  # a --baseline round
    args = parser.parse_args()
    if args.baseline is not None:
        argv = _without(_without(sys.argv[1:], "--baseline"), "--rounds")
        compare(args.baseline.resolve(), args.rounds, argv)
        return
    if args.threads:
        import torch

        torch.set_num_threads(args.threads)
    results = asyncio.run(main_async(args))
    if args.json_schema:
        return
    if args.json:
        print(json.dumps([asdict(r) for r in results]))
        return
    base = results[0].decode_tokens_per_s
    print(f"\n{'concurrency':>11} {'decode tok/s':>13} {'vs first':>9} {'ITL ms':>8} {'TTFT ms':>8}")
    for r in results:
        print(
            f"{r.concurrency:>11} {r.decode_tokens_per_s:>13.1f} {r.decode_tokens_per_s / base:>8.2f}x "
            f"{r.mean_itl_ms:>8.1f} {r.ttft_ms:>8.1f}"
        )


def _without(argv: list[str], flag: str) -> list[str]:
    """argv less `flag` and its value (either `--flag v` or `--flag=v`)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == flag:
            skip = True
        elif not a.startswith(flag + "="):
            out.append(a)
    return out


if __name__ == "__main__":
    main()
