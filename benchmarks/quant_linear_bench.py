"""The quantized linears alone, this tree's kernels against another checkout's, in one process.

`QuantLinear` on the default model's shapes (1536 x 576, 576 x 1536, 960 x 576: gate/up, down, q/k/v; or each
`--shape`, such as its head's, 49152x576, which streams from memory) in Q4_1 (or `--type`: Q8_0 is the default
model's head, and has the int8 records of Q5_0 and Q6_K), x of each `--rows` count in `--dtype`, the two builds
alternated round by round, the best round of each summed over the shapes; the last column says whether both gave
the same bits (a change of arithmetic, such as another tier's dot products, shows there). Both builds are for
this CPU's own tier, or the one BRINE_CPU_TIER names.

    git worktree add /tmp/before HEAD~1
    .venv/bin/python benchmarks/quant_linear_bench.py --baseline /tmp/before --dtype bfloat16 --threads 2
    .venv/bin/python benchmarks/quant_linear_bench.py --baseline /tmp/before --type q8_0 --shape 49152x576
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.quant_q8_bench import SHAPES, best_per_call, gguf_weights  # noqa: E402
from engine.model.kernels.build import baseline_csrc, build_baseline, load  # noqa: E402
from engine.model.layers.quant_linear import TYPE_NAMES, QuantLinear  # noqa: E402

# the 32-weight types gguf-py can quantize (the K-quants' blocks it cannot write)
TYPES = {
    name.lower(): t for t, name in TYPE_NAMES.items() if name in ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--baseline", type=Path, required=True, help="another checkout: its kernels against this tree's"
    )
    ap.add_argument("--dtype", choices=["bfloat16", "float32"], default="bfloat16")
    ap.add_argument("--rows", default="2048,128,16,4,1", help="comma-separated row counts")
    ap.add_argument("--type", choices=sorted(TYPES), default="q4_1", help="the GGUF type of the weights")
    ap.add_argument(
        "--shape", action="append", help="OUTxIN instead of the default model's three (49152x576: its head)"
    )
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--rounds", type=int, default=5, help="alternated rounds per build (the best counts)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    dtype = getattr(torch, args.dtype)
    kernels, why = load()
    if kernels is None:
        raise SystemExit(f"this tree's kernels are not available: {why}")
    shapes: list[tuple[int, ...]] = (
        [tuple(int(n) for n in s.split("x")) for s in args.shape] if args.shape else list(SHAPES)
    )
    raws = gguf_weights(TYPES[args.type], shapes)
    with tempfile.TemporaryDirectory() as tmp:
        before = build_baseline(baseline_csrc(args.baseline), Path(tmp) / "baseline.so")
        builds = {"baseline": before, "this tree": kernels}
        print(
            f"{args.type}, {args.dtype}, {args.threads} threads; tiers: baseline {before.tier}, this tree {kernels.tier}"
        )
        print("| rows | baseline | this tree | baseline / this tree | same bits |")
        print("|---|---|---|---|---|")
        for rows in (int(r) for r in args.rows.split(",")):
            total = dict.fromkeys(builds, 0.0)
            same = True
            for out_f, in_f in shapes:
                layers = {
                    k: QuantLinear(b, TYPES[args.type], raws[out_f, in_f], in_f) for k, b in builds.items()
                }
                x = torch.randn(rows, in_f).to(dtype)
                outs = [layer(x) for layer in layers.values()]
                same = same and torch.equal(outs[0], outs[1])
                best = best_per_call(layers, x, args.rounds, reps=max(1, 2000 // rows))
                for k in total:
                    total[k] += best[k]
            b, t = total["baseline"] * 1e3, total["this tree"] * 1e3
            print(
                f"| {rows} | {b:.3f} ms | {t:.3f} ms | {b / t:.2f}x | {'yes' if same else 'NO'} |", flush=True
            )


if __name__ == "__main__":
    main()
