"""LoRA adapters' cost: decode tok/s of 16 streams with 0, 1 and 4 adapters in the batch, one process, one run.

Two engines on the default model: `plain` (no --enable-lora: the native one-call layer stack where it applies)
and `lora` (--enable-lora with 4 random rank-8 adapters on every q/k/v/o and MLP linear, which runs the layers
from Python). The streams of the `lora` engine are spread over 0 (all base), 1 or 4 adapters. Rounds alternate
the order of the cases (these machines are noisy); the median of `--rounds` is reported.

Decode tok/s counts the tokens after every stream has its first token, over the time to the last one (the
prefill left out), as decode_bench does. Each stream has its own random prompt (nothing shared).

    .venv/bin/python benchmarks/lora_bench.py [--streams 16] [--tokens 64] [--rounds 3] [--dtype bfloat16]
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.model.kernels.invariance import isa_summary
from engine.request import Origin
from engine.sampling_params import SamplingParams
from kv_cache.namespace import CacheNamespace

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "engine"))
from lora_helpers import default_model_shapes, write_adapter  # noqa: E402

NAMES = ("a0", "a1", "a2", "a3")


async def decode_rate(eng: AsyncEngine, names: list[str | None], tokens: int, seed: int) -> float:
    rng = random.Random(seed)
    first: dict[int, float] = {}  # stream -> when its first token came
    counts = [0] * len(names)
    done: list[float] = []

    async def one(i: int, name: str | None) -> None:
        prompt = [rng.randrange(100, 40000) for _ in range(32)]
        ns = None if name is None else CacheNamespace(lora=eng.loras.get(name).key)
        params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
        async for out in eng.generate(prompt, params, origin=Origin(ns)):
            first.setdefault(i, time.perf_counter())
            counts[i] += sum(len(c.token_ids) for c in out.outputs)
        done.append(time.perf_counter())

    await asyncio.gather(*(one(i, n) for i, n in enumerate(names)))
    # Tokens after the last stream's first token, over the time from then to the last one.
    return (sum(counts) - len(names)) / (max(done) - max(first.values()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--streams", type=int, default=16)
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--dtype", default="bfloat16")
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp())
    layers, shapes = default_model_shapes()
    mods = [(n, str(write_adapter(tmp / n, layers, shapes, seed=i, std=0.02))) for i, n in enumerate(NAMES)]
    common = dict(device="cpu", dtype=args.dtype, max_num_seqs=args.streams, enable_prefix_caching=False)
    plain = AsyncEngine.from_config(EngineConfig(**common))
    lora = AsyncEngine.from_config(EngineConfig(**common, enable_lora=True, lora_modules=mods))
    s = args.streams
    cases = {
        "no --enable-lora (native stack)": (plain, [None] * s),
        "--enable-lora, 0 adapters": (lora, [None] * s),
        "--enable-lora, 1 adapter": (lora, [NAMES[0]] * s),
        "--enable-lora, 4 adapters": (lora, [NAMES[i % 4] for i in range(s)]),
    }
    rates: dict[str, list[float]] = {k: [] for k in cases}
    try:
        for r in range(args.rounds):
            order = list(cases) if r % 2 == 0 else list(reversed(cases))
            for k in order:
                eng, names = cases[k]
                rates[k].append(asyncio.run(decode_rate(eng, names, args.tokens, seed=r)))
    finally:
        plain.shutdown()
        lora.shutdown()
    base = statistics.median(rates["--enable-lora, 0 adapters"])
    print(f"# {isa_summary()}; {args.dtype}, {s} streams x {args.tokens} tokens, median of {args.rounds}")
    print("| case | decode tok/s | vs --enable-lora base |")
    print("|---|---|---|")
    for k, v in rates.items():
        m = statistics.median(v)
        print(f"| {k} | {m:.1f} | {m / base:.2f}x |")


if __name__ == "__main__":
    main()
