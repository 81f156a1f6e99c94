"""What a verification step costs on this machine: a decode step whose sequences each carry K drafts, against
the plain decode step of the same batch (K = 0), at several batch sizes.

Speculation pays when a step of K + 1 rows per sequence costs little more than a step of one row (decode is
memory-bound: the weights are read once however many rows there are) and stops paying where the step turns
compute-bound. This measures that directly, without depending on how often drafts are accepted: an
`EngineCore` over the real `ModelRunner` (default model and dtype unless told), B sequences with a
`--context`-token prompt each, then decode steps in which every sequence is handed exactly K drafts (tokens
that are then mostly rejected: the step's cost does not depend on acceptance). Each (B, K) is timed over
`--steps` steps, the cases interleaved round by round (these machines are noisy); medians, ms, and each
K's step time over K = 0's in the same rounds.

With acceptance a (tokens emitted per step, from spec_decode_bench's "steps off/on"), the speed-up of a batch
is a / (cost(K) / cost(0)): the break-even acceptance at each (B, K) is the ratio printed.

`--kernels ROWS` instead times a verify chunk's kernels one by one, without an engine: the default model's
quantized linears (Q4_1 qkv, o, gate/up and down in 30 layers, each its own weights so that they come from
memory as in a step; the Q8_0 output head) and its attention (9 heads, 3 KV heads, head_dim 64, 30 layers'
caches of `--context` tokens in scattered blocks), for one sequence of each of ROWS query tokens; CPU time, ms
per step (`--clock wall`: wall time, what a step waits on, which two threads' imbalance adds to and an idle
thread's spinning does not). With `--baseline DIR` each kernel alternates with another checkout's (built for the same tier),
`--runs` times (7 unless told), and the line gives the median of the paired runs' ratios and says whether their
outputs have the same bits: the before / after of a kernel change.

    .venv/bin/python benchmarks/spec_step_cost.py                          # B 1,4,8,16,32; K 0,1,2,4,8
    .venv/bin/python benchmarks/spec_step_cost.py --batch 1 --draft 0,4,8,16 --context 2000
    .venv/bin/python benchmarks/spec_step_cost.py --kernels 1,2,3,5,9 --threads 1 --baseline /tmp/before
    .venv/bin/python benchmarks/spec_step_cost.py --kernels 1,5,7,9,16 --clock wall --baseline /tmp/before
    .venv/bin/python benchmarks/spec_step_cost.py --kernels 1,5,9 --clock wall --runs 80 --baseline /tmp/before
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import os
import random
import statistics
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path

import numpy as np
import torch

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.model.attention.base import AttentionMetadata
from engine.model.attention.native import NativeBackend
from engine.model.device import resolve_dtype
from engine.model.kernels.build import DTYPE_CODES, Kernels, baseline_csrc, build_baseline, load
from engine.model.layers.quant_linear import GGML_Q4_1, GGML_Q8_0, KERNEL_KIND, records
from engine.model.loading.files import resolve_model
from engine.model_runner import ModelRunner
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.spec_config import SpeculativeConfig
from engine.threads import set_torch_threads
from engine.tokenizer import Tokenizer


def make_core(args: argparse.Namespace, max_seqs: int, max_k: int) -> EngineCore:
    """On the calling thread, which then steps it: one OpenMP pool (engine.threads)."""
    files = resolve_model(args.model)
    set_torch_threads(args.threads)
    spec = SpeculativeConfig(
        num_speculative_tokens=max(1, max_k),
        disable_by_batch_size=max_seqs,
        max_draft_tokens_per_step=max(1, max_k) * max_seqs,
    )
    config = EngineConfig(
        model=str(files.path),
        dtype=args.dtype,
        max_num_seqs=max_seqs,
        max_num_batched_tokens=max(2048, max_seqs * (max_k + 1)),
        enable_prefix_caching=False,
        speculative_config=spec,
        threads=args.threads,
    )
    return EngineCore(ModelRunner(config), Tokenizer(files.path), config)


def prompt(core: EngineCore, n: int, salt: int) -> list[int]:
    text = " ".join(
        f"Item {salt}.{i}: the quick brown fox jumps over the lazy dog near river {i}." for i in range(n)
    )
    return core.tokenizer.encode(text, add_special_tokens=False)[:n]  # type: ignore[attr-defined]


# The default model's (SmolLM2-135M, Q4_1 GGUF) quantized linears: (GGML type, out, in, copies per step)
LINEARS = {
    "qkv": (GGML_Q4_1, 960, 576, 30),
    "o": (GGML_Q4_1, 576, 576, 30),
    "gate_up": (GGML_Q4_1, 3072, 576, 30),
    "down": (GGML_Q4_1, 576, 1536, 30),
    "head": (GGML_Q8_0, 49152, 576, 1),
}


def random_records(rng: np.random.Generator, ggml_type: int, n: int, k: int) -> torch.Tensor:
    d = (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float16)
    if ggml_type == GGML_Q8_0:
        return torch.from_numpy(records(ggml_type, rng.integers(-127, 128, (n, k)).astype(np.int8), d, None))
    m = (rng.standard_normal((n, k // 32)) * 0.01).astype(np.float16)
    return torch.from_numpy(records(ggml_type, rng.integers(0, 16, (n, k)).astype(np.uint8), d, m))


def run_linear(kern: Kernels, ggml_type: int, weights: list[torch.Tensor], x: torch.Tensor) -> torch.Tensor:
    """x through every copy of one linear (the default model's layers), as a step runs them."""
    (m, k), n = x.shape, weights[0].shape[0] * 16
    out = torch.empty(m, n, dtype=x.dtype)
    code = DTYPE_CODES[x.dtype]
    assert kern.quant_linear is not None
    for w in weights:
        kern.quant_linear(KERNEL_KIND[ggml_type], w.data_ptr(), n, k, code, x.data_ptr(), m, k, None,
                          out.data_ptr(), n, code, torch.get_num_threads())  # fmt: skip
    return out


def run_attention(kern: Kernels, q: torch.Tensor, meta: AttentionMetadata, caches: list) -> torch.Tensor:
    """One sequence's attention in every layer (9 heads, 3 KV heads, head_dim 64, block size 16)."""
    backend = NativeBackend(kern)
    plan = backend.plan(meta)
    return torch.stack([backend.forward(q, q, q, kc, vc, plan, None, 64**-0.5) for kc, vc in caches])


def kernel_costs(args: argparse.Namespace) -> None:
    """--kernels: each kernel of a verify chunk of R tokens, ms per step (--clock's), against --baseline's."""
    clock = time.process_time if args.clock == "cpu" else time.perf_counter
    if args.threads:
        torch.set_num_threads(args.threads)
    dtype = resolve_dtype(args.dtype, torch.device("cpu"))
    mine, why = load()
    if mine is None:
        raise SystemExit(f"no native kernels: {why}")
    kernels: dict[str, Kernels] = {"this tree": mine}
    if args.baseline is not None:
        tmp = tempfile.mkdtemp(prefix="spec-step-cost-")
        kernels = {"baseline": build_baseline(baseline_csrc(args.baseline), Path(tmp) / "b.so"), **kernels}
    rows = [int(r) for r in args.kernels.split(",")]
    rng = np.random.default_rng(0)
    print(f"tier {mine.tier}, {str(dtype).removeprefix('torch.')}, {torch.get_num_threads()} threads, context {args.context}; "
          f"median of {args.runs} alternated runs, ms per step ({args.clock} time): {' -> '.join(kernels)}"
          + (" (the median of the runs' paired ratios)" if len(kernels) > 1 else ""))  # fmt: skip
    totals = {name: [0.0] * len(rows) for name in kernels}

    def timed(calls: dict[str, Callable[[], torch.Tensor]]) -> tuple[dict[str, float], bool, float | None]:
        """Medians, whether the outputs have the same bits, and (two calls) the median of the runs' ratios of
        the first's time over the second's: a pair of runs shares the machine's state of the moment, which on
        these machines moves both by more than a kernel change does."""
        times: dict[str, list[float]] = {name: [] for name in calls}
        outs = {}
        for rep in range(args.runs + 1):
            for name, call in calls.items() if rep % 2 else reversed(calls.items()):
                t0 = clock()
                outs[name] = call()
                if rep:  # the first: warm-up
                    times[name].append(clock() - t0)
        got = list(outs.values())
        same = all(torch.equal(o.view(torch.uint8), got[0].view(torch.uint8)) for o in got)
        series = list(times.values())
        paired = statistics.median(a / b for a, b in zip(*series, strict=True)) if len(series) == 2 else None
        return {name: 1000 * statistics.median(t) for name, t in times.items()}, same, paired

    def report(label: str, per_rows: list[tuple[dict[str, float], bool, float | None]]) -> None:
        cells = []
        for i, (ms, same, paired) in enumerate(per_rows):
            for name, v in ms.items():
                totals[name][i] += v
            cell = " -> ".join(f"{v:6.2f}" for v in ms.values())
            cell += f" ({paired:.2f}x)" if paired is not None else ""
            cells.append(f"R={rows[i]}: {cell}" + ("" if same else " (bits differ)"))
        print(f"{label:10} " + "  ".join(cells), flush=True)

    for label, (ggml_type, n, k, copies) in LINEARS.items():
        weights = [random_records(rng, ggml_type, n, k) for _ in range(copies)]
        per_rows = []
        for r in rows:
            x = torch.randn(r, k).to(dtype)
            per_rows.append(
                timed(
                    {name: partial(run_linear, kern, ggml_type, weights, x) for name, kern in kernels.items()}
                )
            )
        report(label, per_rows)
    blocks = args.context // 16 + 2
    caches = [tuple(torch.randn(blocks, 16, 3, 64).to(dtype) for _ in range(2)) for _ in range(30)]
    table = random.Random(0).sample(range(blocks), blocks)
    per_rows = []
    for r in rows:
        meta = AttentionMetadata([r], [args.context], [table], 16, torch.zeros(0, dtype=torch.int64))
        q = torch.randn(r, 9, 64).to(dtype)
        per_rows.append(
            timed({name: partial(run_attention, kern, q, meta, caches) for name, kern in kernels.items()})
        )
    report("attention", per_rows)
    for name, ms in totals.items():
        print(f"{'all':10} {name}: " + "  ".join(f"R={r}: {v:6.2f}" for r, v in zip(rows, ms, strict=True)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,4,8,16,32")
    p.add_argument("--draft", default="0,1,2,4,8")
    p.add_argument("--context", type=int, default=2000)
    p.add_argument("--steps", type=int, default=6, help="steps per (B, K) per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--runs", type=int, default=7, help="--kernels: alternated runs per kernel and row count")
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument(
        "--kernels", metavar="ROWS", help="time each kernel for these query rows instead (1,2,3,5,9)"
    )
    p.add_argument(
        "--baseline", type=Path, help="with --kernels: another checkout's kernels against this tree's"
    )
    p.add_argument(
        "--clock",
        choices=("cpu", "wall"),
        default="cpu",
        help="with --kernels: CPU time (the threads' work) or wall time (what a step waits: an idle thread's "
        "spinning counts as CPU time, and a stall of one thread shows only in wall time)",
    )
    args = p.parse_args()
    if args.kernels:
        return kernel_costs(args)
    batches = [int(b) for b in args.batch.split(",")]
    ks = [int(k) for k in args.draft.split(",")]
    core = make_core(args, max(batches), max(ks))
    spec = core.scheduler.spec
    assert spec is not None
    want = {"k": 0}

    def propose(req: Request, budget: int) -> list[int]:  # exactly K drafts: the last token repeated
        return [req.all_token_ids[-1]] * min(want["k"], budget)

    spec.propose = propose  # type: ignore[method-assign]
    print(
        f"load average {os.getloadavg()[0]:.2f}; context {args.context}; steps {args.steps} x {args.rounds}"
    )
    times: dict[tuple[int, int], list[float]] = {(b, k): [] for b in batches for k in ks}
    cpu: dict[tuple[int, int], list[float]] = {(b, k): [] for b in batches for k in ks}
    for b in batches:
        # Enough tokens for every timed step, K + 1 per step at most.
        params = SamplingParams(
            max_tokens=(args.steps + 1) * args.rounds * sum(k + 1 for k in ks) + 4 * max(ks) + 8,
            temperature=0.0,
            ignore_eos=True,
        )
        for i in range(b):
            failed = core.add_request(f"r{b}.{i}", prompt(core, args.context, 1000 * b + i), params)
            if failed:
                raise SystemExit(f"request not added: {failed}")
        while (
            any(r.num_tokens - r.num_computed_tokens > 1 for r in core.scheduler.running)
            or core.scheduler.waiting
        ):
            core.step()  # prefill (not timed)
        for k in ks:  # warm: the first step of a new shape may build kernels
            want["k"] = k
            core.step()
            core.step()
        for r in range(args.rounds):
            order = ks if r % 2 == 0 else ks[::-1]
            for k in order:
                want["k"] = k
                core.step()  # the first step at a new K may still carry the last K's leftovers
                for _ in range(args.steps):
                    t0, c0 = time.perf_counter(), time.process_time()
                    core.step()
                    times[b, k].append(time.perf_counter() - t0)
                    cpu[b, k].append(time.process_time() - c0)
        for i in range(b):
            core.abort_request(f"r{b}.{i}")
        # The median, and the fastest step (on a loaded machine, the one least disturbed by other work).
        for name, got, pick in (
            ("median", times, statistics.median),
            ("min", times, min),
            ("cpu median", cpu, statistics.median),
        ):
            base = pick(got[b, 0]) if 0 in ks else float("nan")
            cells = "  ".join(
                f"K={k}: {1000 * pick(got[b, k]):6.1f} ms ({pick(got[b, k]) / base:4.2f}x)" for k in ks
            )
            print(f"B={b:>3} {name:>10}  {cells}", flush=True)
    print(f"load average {os.getloadavg()[0]:.2f}")
    core.close()


if __name__ == "__main__":
    main()
