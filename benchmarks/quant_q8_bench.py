"""`--quantize-activations q8` against the float path: the linears alone, per kernel build, or the engine.

Linears (default): QuantLinear on the default model's Q4_1 shapes (1536 x 576, 576 x 1536, 960 x 576: gate/up,
down, q/k/v), float32 x of 2,048, 16 and 1 rows, the float path and q8 alternated, best of 3, summed over the
three shapes. `--builds` names the kernel builds (engine/model/kernels/build.py's tiers, or "native").

`--engine`: the default model in process (this process's tier: set BRINE_CPU_TIER and the oneDNN / ATen caps
to emulate one), a cold 2,029-token prompt's time to first token (best of 2) and a 64-token greedy decode,
without and with q8.

    .venv/bin/python benchmarks/quant_q8_bench.py --builds avx2,avx512,native --threads 1
    BRINE_CPU_TIER=avx2 ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2 \\
        .venv/bin/python benchmarks/quant_q8_bench.py --engine --dtype float32
"""

from __future__ import annotations

import argparse
import asyncio
import random
import time
from collections.abc import Callable, Hashable
from typing import TypeVar

import numpy as np
import torch

SHAPES = [(1536, 576), (576, 1536), (960, 576)]  # (out, in)

K = TypeVar("K", bound=Hashable)


def gguf_weights(
    ggml_type: int | None = None, shapes: list[tuple[int, ...]] | None = None
) -> dict[tuple[int, ...], np.ndarray]:
    """Each of SHAPES (or `shapes`) as Q4_1 blocks (or `ggml_type`'s), as a GGUF stores them: seeded random
    weights of scale 1 / sqrt(in)."""
    from gguf import quants

    from engine.model.layers.quant_linear import GGML_Q4_1

    kind = GGML_Q4_1 if ggml_type is None else ggml_type  # (not `or`: GGML type 0 is F32)
    rng = np.random.default_rng(0)
    return {
        s: quants.quantize(rng.standard_normal(s).astype(np.float32) * s[1] ** -0.5, kind)
        for s in shapes or SHAPES
    }


def best_per_call(
    layers: dict[K, Callable[[torch.Tensor], object]], x: torch.Tensor, rounds: int, reps: int
) -> dict[K, float]:
    """Seconds per call of each layer on x: the best of `rounds` rounds of `reps` calls, the layers taking turns
    round by round (these machines are noisy: each round falls on all of them alike)."""
    best = dict.fromkeys(layers, float("inf"))
    for _ in range(rounds):
        for k, layer in layers.items():
            t0 = time.perf_counter()
            for _ in range(reps):
                layer(x)
            best[k] = min(best[k], (time.perf_counter() - t0) / reps)
    return best


def linears(builds: list[str]) -> None:
    from engine.model.kernels import build as native_kernels
    from engine.model.layers.quant_linear import GGML_Q4_1, QuantLinear

    raws = gguf_weights()
    print(f"| build | rows | float | q8 | speed-up |  ({torch.get_num_threads()} thread(s))")
    print("|---|---|---|---|---|")
    for name in builds:
        kernels, why = native_kernels.load(None if name == "native" else name)
        if kernels is None:
            print(f"| {name} | | | | not built: {why} |")
            continue
        for rows in (2048, 16, 1):
            total = {False: 0.0, True: 0.0}
            for out_f, in_f in SHAPES:
                layers = {
                    q8: QuantLinear(kernels, GGML_Q4_1, raws[out_f, in_f], in_f, q8_activations=q8)
                    for q8 in total
                }
                x = torch.randn(rows, in_f)
                # 4 rounds: the first warms up
                best = best_per_call(layers, x, rounds=4, reps=3 if rows > 100 else 200)
                for q8 in total:
                    total[q8] += best[q8]
            f, q = total[False] * 1e3, total[True] * 1e3
            print(f"| {kernels.tier} | {rows} | {f:.3f} ms | {q:.3f} ms | {f / q:.2f}x |")


def engine(dtype: str) -> None:
    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig
    from engine.model.kernels.build import describe
    from engine.sampling_params import SamplingParams

    rng = random.Random(0)
    prompt = [rng.randrange(100, 49000) for _ in range(2029)]
    print(f"kernels: {describe()}, dtype {dtype}")
    for mode in ("none", "q8"):
        eng = AsyncEngine.from_config(
            EngineConfig(device="cpu", dtype=dtype, quantize_activations=mode, enable_prefix_caching=False)
        )

        async def one(p: list[int], n: int, eng=eng) -> tuple[float, float, list[int]]:
            t0 = time.perf_counter()
            first, tokens = None, []
            async for out in eng.generate(p, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)):
                first = first if first is not None else time.perf_counter() - t0
                for c in out.outputs:
                    tokens += c.token_ids
            assert first is not None
            return first, time.perf_counter() - t0, tokens

        async def run(one=one) -> str:
            await one(prompt[:50], 2)
            ttft = min([(await one([rng.randrange(100, 49000)] + prompt[1:], 1))[0] for _ in range(2)])
            first, total, tokens = await one(prompt[:20], 65)
            return f"cold 2,029-token TTFT {ttft * 1e3:.0f} ms, decode {64 / (total - first):.1f} tok/s, first tokens {tokens[:8]}"

        try:
            print(f"{mode}: {asyncio.run(run())}")
        finally:
            eng.shutdown()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--builds", default="avx2,avx512,native")
    ap.add_argument("--threads", type=int, default=1, help="for the linears (the engine uses its default)")
    ap.add_argument("--engine", action="store_true")
    ap.add_argument("--dtype", default="float32")
    args = ap.parse_args()
    if args.engine:
        engine(args.dtype)
    else:
        torch.set_num_threads(args.threads)
        linears(args.builds.split(","))


if __name__ == "__main__":
    main()
