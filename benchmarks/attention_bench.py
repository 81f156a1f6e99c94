"""CPU attention backends side by side, one layer at a time: the native C++ kernel against the tiled torch one.

Each case is one request in one step over a paged cache whose blocks are handed out in random order, with the
default model's attention shape unless told (9 query heads, 3 KV heads, head_dim 64, block size 16,
bfloat16): a decode at a short and a long context, a 16-token chunk over ~2,000 cached, fresh prefills,
decodes whose cached context comes from DRAM, speculative verify chunks (a token and its 2, 4 or 8 drafts over
2,000 cached tokens in DRAM), and a question's 13 tokens over a cached ~2,000-token document in DRAM (see
CASES; `--cases TEXT` runs only those whose name holds TEXT). Both
backends run alternately on the same inputs in one process and the median of `--repeats` runs is reported,
with tiled / native (these machines are noisy: compare ratios).

`--kv-float16` instead times the native kernel on float32 queries over a float16 cache (`--kv-cache-dtype
float16`) against over a float32 cache that holds the same numbers, and says whether their outputs have the
same bits (they must).

`--baseline DIR` instead times another checkout's native kernel (DIR/engine/model/kernels/csrc, or
engine/model/csrc in checkouts from before the redesign, built into a temporary
directory) against this tree's, alternating run by run, and says whether their outputs have the same bits: the
before / after of a kernel change; with `--kv-float16`, both over the float16 cache.

    .venv/bin/python benchmarks/attention_bench.py
    .venv/bin/python benchmarks/attention_bench.py --threads 1 --dtype float32
    .venv/bin/python benchmarks/attention_bench.py --kv-float16 --cases DRAM
    git worktree add /tmp/before HEAD~1 && .venv/bin/python benchmarks/attention_bench.py --baseline /tmp/before
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Collection
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.model.attention.base import AttentionMetadata  # noqa: E402
from engine.model.attention.native import NativeBackend  # noqa: E402
from engine.model.attention.tiled import TiledBackend  # noqa: E402
from engine.model.device import DTYPES  # noqa: E402
from engine.model.kernels.build import baseline_csrc, build_baseline, load  # noqa: E402

# name -> (new tokens, context, cache): "small" caches hold little more than the case's blocks (they stay in
# the CPU's caches from run to run); "large" ones are ~300 MB at the default shape, and every run, of either
# backend, reads another of 64 block tables scattered over them (all 64 touch far more than the CPU's caches
# hold), so the context comes from DRAM, as a cached prompt's does in a server.
CASES = {
    "decode, 128 context": (1, 128, "small"),
    "decode, 2,000 context": (1, 2000, "small"),
    "warm: 16 new over 2,000": (16, 2000, "small"),
    "prefill 512": (512, 512, "small"),
    "prefill 2,048": (2048, 2048, "small"),
    "decode, 2,000 in DRAM": (1, 2000, "large"),
    "decode, 8,000 in DRAM": (1, 8000, "large"),
    # a speculative step's verify chunk: one sequence's token and its drafts over a cached context
    "verify: 3 over 2,000 in DRAM": (3, 2000, "large"),
    "verify: 5 over 2,000 in DRAM": (5, 2000, "large"),
    "verify: 9 over 2,000 in DRAM": (9, 2000, "large"),
    # a question after a shared document: its 13 tokens over the document's cached ~2,000 (in DRAM, as in a
    # server); 39 rows at the end of a long context, which the AVX2 build gives attend_keys (kKeyRowsTail)
    "question: 13 over 2,016 in DRAM": (13, 2029, "large"),
}
LARGE_BLOCKS = 24_000
TABLES = 64


def time_backends(backends: dict, q, kv: dict, metas: list, scale: float, repeats: int) -> dict[str, float]:
    """Median ms per backend, each over its cache in `kv` (name -> (k, v)); the backends take turns run by run
    (so that the machine's noise falls on all), and each run reads the next of `metas` (so that no backend
    reads blocks the other has just brought in)."""
    plans = {k: [b.plan(m) for m in metas] for k, b in backends.items()}
    times: dict[str, list[float]] = {k: [] for k in backends}
    with torch.inference_mode():
        for k, b in backends.items():
            b.forward(q, q, q, *kv[k], plans[k][0], None, scale)  # warm-up
        for r in range(repeats):
            for i, (k, b) in enumerate(backends.items()):
                t0 = time.perf_counter()
                b.forward(q, q, q, *kv[k], plans[k][(r * len(backends) + i) % len(metas)], None, scale)
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
    ap.add_argument("--cases", default="", help="only the cases whose name contains this text")
    ap.add_argument(
        "--kv-float16", action="store_true", help="a float32 cache against a float16 one (float32)"
    )
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    kernels, why = load()
    if kernels is None:
        print(f"the native kernels are not available here: {why}")
        return 1
    if args.kv_float16:
        args.dtype = "float32"
    if args.kv_float16 and args.baseline is None:
        backends = {"float32 KV": NativeBackend(kernels), "float16 KV": NativeBackend(kernels)}
        return run_cases(args, backends, "alternating runs", halves={"float16 KV"})
    if args.baseline is None:
        backends = {
            "tiled": TiledBackend(torch.device("cpu"), args.head_dim),
            "native": NativeBackend(kernels),
        }
        return run_cases(args, backends, "runs")
    with tempfile.TemporaryDirectory() as tmp:
        before = build_baseline(baseline_csrc(args.baseline), Path(tmp) / "baseline.so")
        backends = {"baseline": NativeBackend(before), "this tree": NativeBackend(kernels)}
        # --kv-float16: both kernels over the same float16 cache
        return run_cases(args, backends, f"alternating runs; baseline {args.baseline}",
                         halves=set(backends) if args.kv_float16 else ())  # fmt: skip


def run_cases(args: argparse.Namespace, backends: dict, what: str, halves: Collection[str] = ()) -> int:
    """Every case on both backends: their ms per layer, the first over the second, and (for two native
    kernels) whether their outputs have the same bits. `halves`: the backends that read the float16 cache
    (`--kv-float16`), the others its numbers in float32."""
    dtype, bs, hkv, d = DTYPES[args.dtype], args.block_size, args.kv_heads, args.head_dim
    g = torch.Generator().manual_seed(0)
    small_blocks = max(ctx for _, ctx, _ in CASES.values()) // bs + 8
    caches = {
        size: tuple(torch.randn(blocks, bs, hkv, d, generator=g).to(dtype) for _ in range(2))
        for size, blocks in (("small", small_blocks), ("large", LARGE_BLOCKS))
    }
    if args.kv_float16:
        # the float32 cache holds the float16 cache's numbers: the outputs must have the same bits
        caches = {size: tuple(c.half().float() for c in kv) for size, kv in caches.items()}
        half = {size: tuple(c.half() for c in kv) for size, kv in caches.items()}
    first, second = backends
    native_pair = all(isinstance(b, NativeBackend) for b in backends.values())
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, {args.dtype}, {args.heads} heads / "
        f"{hkv} kv heads, head_dim {d}, block size {bs}; median of {args.repeats} {what}, ms per layer"
    )
    print(
        f"{'case':26} {first:>10} {second:>10} {first + '/' + second:>20}"
        + (f" {'same bits':>10}" if native_pair else "")
    )
    rng = random.Random(0)
    for name, (n, ctx, size) in CASES.items():
        if args.cases not in name:
            continue
        kc, vc = caches[size]
        kv = {b: half[size] if b in halves else (kc, vc) for b in backends}
        tables = [
            rng.sample(range(1, kc.shape[0]), -(-ctx // bs)) for _ in range(1 if size == "small" else TABLES)
        ]
        metas = [AttentionMetadata([n], [ctx], [t], bs, torch.zeros(0, dtype=torch.int64)) for t in tables]
        q = torch.randn(n, args.heads, d, generator=g).to(dtype)
        reps = max(3, args.repeats // (1 + n // 256))
        ms = time_backends(backends, q, kv, metas, d**-0.5, reps)
        line = f"{name:26} {ms[first]:10.3f} {ms[second]:10.3f} {ms[first] / ms[second]:19.2f}x"
        if native_pair:
            with torch.inference_mode():
                outs = [
                    b.forward(q, q, q, *kv[k], b.plan(metas[0]), None, d**-0.5) for k, b in backends.items()
                ]
            line += f" {'yes' if same_bits(*outs) else 'NO':>10}"
        print(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
