"""CPU attention backends side by side, one layer at a time: the native C++ kernel against the tiled torch one.

Each case is one request in one step over a paged cache whose blocks are handed out in random order, with the
default model's attention shape unless told (9 query heads, 3 KV heads, head_dim 64, block size 16,
bfloat16): a decode at a short and a long context, a warm chunk (16 new tokens over ~2,000 cached, the step
behind a warm TTFT) and fresh prefills. Both backends run alternately on the same inputs in one process and
the median of `--repeats` runs is reported, with tiled / native (these machines are noisy: compare ratios).

    .venv/bin/python benchmarks/attention_bench.py
    .venv/bin/python benchmarks/attention_bench.py --threads 1 --dtype float32
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model.attention import AttentionMetadata  # noqa: E402
from engine.model.device import DTYPES  # noqa: E402
from engine.model.native_attention import NativeBackend  # noqa: E402
from engine.model.native_kernels import load  # noqa: E402
from engine.model.tiled_attention import TiledBackend  # noqa: E402

# name -> (new tokens, context)
CASES = {
    "decode, 128 context": (1, 128),
    "decode, 2,000 context": (1, 2000),
    "warm: 16 new over 2,000": (16, 2000),
    "prefill 512": (512, 512),
    "prefill 2,048": (2048, 2048),
}


def time_one(backend, q, kc, vc, meta, scale: float, repeats: int) -> float:
    plan = backend.plan(meta)
    with torch.inference_mode():
        backend.forward(q, q, q, kc, vc, plan, None, scale)  # warm-up
        times = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            backend.forward(q, q, q, kc, vc, plan, None, scale)
            times.append(time.perf_counter() - t0)
    return statistics.median(times) * 1000


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=20)
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels, why = load()
    if kernels is None:
        print(f"the native kernels are not available here: {why}")
        return 1
    dtype, bs, hkv, d = DTYPES[args.dtype], args.block_size, args.kv_heads, args.head_dim
    num_blocks = max(n for _, n in CASES.values()) // bs + 8
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    vc = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    backends = {"tiled": TiledBackend(torch.device("cpu"), d), "native": NativeBackend(kernels)}
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, {args.heads} heads / "
        f"{hkv} kv heads, head_dim {d}, block size {bs}; median of {args.repeats} runs, ms per layer"
    )
    print(f"{'case':26} {'tiled':>10} {'native':>10} {'tiled/native':>13}")
    rng = random.Random(0)
    for name, (n, ctx) in CASES.items():
        table = rng.sample(range(1, num_blocks), -(-ctx // bs))
        meta = AttentionMetadata([n], [ctx], [table], bs, torch.zeros(0, dtype=torch.int64))
        q = torch.randn(n, args.heads, d, generator=g).to(dtype)
        reps = max(3, args.repeats // (1 + n // 256))
        ms = {k: time_one(b, q, kc, vc, meta, d**-0.5, reps) for k, b in backends.items()}
        print(f"{name:26} {ms['tiled']:10.3f} {ms['native']:10.3f} {ms['tiled'] / ms['native']:12.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
