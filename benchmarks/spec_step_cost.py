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

    .venv/bin/python benchmarks/spec_step_cost.py                          # B 1,4,8,16,32; K 0,1,2,4,8
    .venv/bin/python benchmarks/spec_step_cost.py --batch 1 --draft 0,4,8,16 --context 2000
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import os
import statistics
import time

from engine.config import EngineConfig
from engine.engine_core import EngineCore
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", default="1,4,8,16,32")
    p.add_argument("--draft", default="0,1,2,4,8")
    p.add_argument("--context", type=int, default=2000)
    p.add_argument("--steps", type=int, default=6, help="steps per (B, K) per round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--model", default=None)
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    args = p.parse_args()
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
