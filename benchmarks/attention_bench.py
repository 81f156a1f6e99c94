"""CPU attention backends side by side, one layer at a time: the native C++ kernel against the tiled torch one.

Each case is one request in one step over a paged cache whose blocks are handed out in random order, with the
default model's attention shape unless told (9 query heads, 3 KV heads, head_dim 64, block size 16,
bfloat16): a decode at a short and a long context, a warm chunk (16 new tokens over ~2,000 cached, the step
behind a warm TTFT) and fresh prefills. Both backends run alternately on the same inputs in one process and
the median of `--repeats` runs is reported, with tiled / native (these machines are noisy: compare ratios).

`--baseline DIR` instead times another checkout's native kernel (DIR/engine/model/csrc, built into a temporary
directory) against this tree's, alternating run by run, and says whether their outputs have the same bits: the
before / after of a kernel change.

    .venv/bin/python benchmarks/attention_bench.py
    .venv/bin/python benchmarks/attention_bench.py --threads 1 --dtype float32
    git worktree add /tmp/before HEAD~1 && .venv/bin/python benchmarks/attention_bench.py --baseline /tmp/before
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model.attention import AttentionMetadata  # noqa: E402
from engine.model.device import DTYPES  # noqa: E402
from engine.model.native_attention import NativeBackend  # noqa: E402
from engine.model.native_kernels import build_baseline, load  # noqa: E402
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


def time_alternating(backends: dict, q, kc, vc, meta, scale: float, repeats: int) -> dict[str, float]:
    """Median ms per backend, the backends taking turns run by run (so that the machine's noise falls on all)."""
    plans = {k: b.plan(meta) for k, b in backends.items()}
    times: dict[str, list[float]] = {k: [] for k in backends}
    with torch.inference_mode():
        for k, b in backends.items():
            b.forward(q, q, q, kc, vc, plans[k], None, scale)  # warm-up
        for _ in range(repeats):
            for k, b in backends.items():
                t0 = time.perf_counter()
                b.forward(q, q, q, kc, vc, plans[k], None, scale)
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) * 1000 for k, v in times.items()}


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--heads", type=int, default=9)
    ap.add_argument("--kv-heads", type=int, default=3)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--block-size", type=int, default=16)
    ap.add_argument("--dtype", default="bfloat16", choices=sorted(DTYPES))
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--baseline", type=Path, help="another checkout: its native kernel against this tree's")
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
    if args.baseline is not None:
        with tempfile.TemporaryDirectory() as tmp:
            before = build_baseline(args.baseline / "engine" / "model" / "csrc", Path(tmp) / "baseline.so")
            return compare_kernels(args, NativeBackend(before), NativeBackend(kernels), kc, vc, g)
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


def compare_kernels(args: argparse.Namespace, before: NativeBackend, after: NativeBackend, kc, vc, g) -> int:
    bs, d = args.block_size, args.head_dim
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, {args.heads} heads / "
        f"{args.kv_heads} kv heads, head_dim {d}, block size {bs}; median of {args.repeats} alternating runs, "
        f"ms per layer; baseline {args.baseline}"
    )
    print(f"{'case':26} {'baseline':>10} {'this tree':>10} {'baseline/this':>14} {'same bits':>10}")
    rng = random.Random(0)
    num_blocks = kc.shape[0]
    for name, (n, ctx) in CASES.items():
        table = rng.sample(range(1, num_blocks), -(-ctx // bs))
        meta = AttentionMetadata([n], [ctx], [table], bs, torch.zeros(0, dtype=torch.int64))
        q = torch.randn(n, args.heads, d, generator=g).to(kc.dtype)
        reps = max(3, args.repeats // (1 + n // 256))
        ms = time_alternating({"before": before, "after": after}, q, kc, vc, meta, d**-0.5, reps)
        with torch.inference_mode():
            outs = [b.forward(q, q, q, kc, vc, b.plan(meta), None, d**-0.5) for b in (before, after)]
        print(
            f"{name:26} {ms['before']:10.3f} {ms['after']:10.3f} {ms['before'] / ms['after']:13.2f}x "
            f"{'yes' if same_bits(*outs) else 'NO':>10}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
