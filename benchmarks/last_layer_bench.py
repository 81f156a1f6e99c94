"""The native decoder stack's last layer run for the logits rows only, against it run for every row: a cold
prompt's prefill forward in process, the two alternating in one process (default model and dtype unless told).

A step hands the stack its logits rows on the host (`ForwardContext.logits_rows`, from the runner's host
lists). With them, the last layer writes every row's keys and values and runs its attention, o projection and
MLP for those rows only; without them (None) it runs every row and the rows are picked afterwards, as before
session 31. The same step is run both ways (`ModelRunner._prepare` once, then `_run` with and without the host
rows); both write the same keys and values to the same slots, and the line says whether the logits have the
same bits (they must). Medians of `--repeats` runs each, and the median of the pairs' ratios (these machines
are noisy: compare ratios).

    .venv/bin/python benchmarks/last_layer_bench.py                        # 512 and 2,029 tokens
    BRINE_CPU_TIER=avx2 .venv/bin/python benchmarks/last_layer_bench.py --dtype float32
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from engine.config import EngineConfig  # noqa: E402
from engine.model.kernels.invariance import isa_summary  # noqa: E402
from engine.model.loading.files import resolve_model  # noqa: E402
from engine.model_runner import ModelRunner  # noqa: E402
from engine.outputs import ScheduledRequest  # noqa: E402
from engine.sampling_params import SamplingParams  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or HF directory (default: the embedded SmolLM2)")
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--lengths", default="512,2029", help="prompt lengths, comma-separated")
    ap.add_argument("--repeats", type=int, default=8)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: as set)")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    lengths = [int(n) for n in args.lengths.split(",")]
    block_size = 16
    num_blocks = max(lengths) // block_size + 2
    runner = ModelRunner(
        EngineConfig(
            model=str(resolve_model(args.model).path),
            device="cpu",
            dtype=args.dtype,
            block_size=block_size,
            num_blocks=num_blocks,
            max_num_batched_tokens=max(lengths),
        )
    )
    if runner.layer_stack is None:
        print("the layers run from Python here (no native decoder stack): nothing to compare")
        return 1
    print(
        f"{isa_summary()}; dtype {runner.dtype}, medians of {args.repeats} runs each, ms per prefill forward"
    )
    print(f"{'prompt':>8} {'kept rows':>10} {'every row':>10} {'every / kept':>20} {'same bits':>10}")
    gen = torch.Generator().manual_seed(0)
    blocks = list(range(num_blocks - 1, -1, -1))  # non-contiguous order, as in serving
    for n in lengths:
        prompt = torch.randint(100, 40_000, (n,), generator=gen).tolist()
        req = ScheduledRequest(
            "bench", prompt, 0, blocks, True, SamplingParams(temperature=0.0), prompt, n, 0
        )
        kept = runner._prepare([req])
        every = dataclasses.replace(kept, logits_rows=None)
        times: dict[str, list[float]] = {"kept": [], "every": []}
        logits: dict[str, torch.Tensor] = {}
        with torch.inference_mode():
            runner._run(kept), runner._run(every)  # warm-up
            for _ in range(args.repeats):
                for name, step in (("every", every), ("kept", kept)):
                    start = time.perf_counter()
                    logits[name] = runner._run(step)
                    times[name].append(time.perf_counter() - start)
        ratios = sorted(e / k for e, k in zip(times["every"], times["kept"], strict=True))
        ms = {name: statistics.median(ts) * 1e3 for name, ts in times.items()}
        ratio = f"{statistics.median(ratios):.3f}x ({ratios[0]:.2f}-{ratios[-1]:.2f})"
        same = "yes" if torch.equal(logits["kept"], logits["every"]) else "NO"
        print(f"{n:>8} {ms['kept']:>10.1f} {ms['every']:>10.1f} {ratio:>20} {same:>10}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
