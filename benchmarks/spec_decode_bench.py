"""Speculative decoding on vs off, same engine, one run: decode tok/s on document QA, free text, and batched.

One engine, built with `--spec`'s `--speculative-config`, takes the same requests twice per round, once
with speculation and once without (its scheduler's drafting switched off between runs, when no request is
in flight), over `--rounds` (alternating which goes first: these machines are noisy). One engine, not two:
two engines in one process are two step threads with an OpenMP pool each, which on a 2-core machine
oversubscribes the cores and makes every op sleep and wake (engine.threads), so the steps of both arms
measured then were ~3x slower than a server's and mostly fixed overhead, which flatters speculation.

- `extract`: a ~2,000-token document of numbered clauses (names, dates, amounts drawn from a seed), and
  questions asking for a clause word for word, through the chat template: the answers quote the document;
- `free`: the `unique` workload's prompts (benchmarks.workloads: random words, a question), with little to
  quote;
- each at `--concurrency` levels (1 and 16 by default), every stream on its own document or question.

Decode tok/s counts the tokens after every stream has its first token, over the time to the last one (the
prefill is left out), as decode_bench does. Greedy unless `--seeded` (temperature 0.8, a seed per stream). The
two arms must produce the same tokens: the run fails otherwise (the guarantee, checked on every request).
"steps off/on" is how many fewer decode steps speculation took, which does not depend on the machine's load;
tok/s on over off is that divided by what a step with drafts costs over one without. It counts every pass that
generated a token, express passes included: with several streams, the streams already decoding get passes of
their own inside the later prompts' prefill steps (engine/express.py), so past one stream the column depends
on how arrivals and prefills interleave, and only the tok/s ratio is the comparison.

    .venv/bin/python benchmarks/spec_decode_bench.py                          # K=4, lookup 2..4, 1 and 16
    .venv/bin/python benchmarks/spec_decode_bench.py --spec '{"method": "ngram", "num_speculative_tokens": 8,
        "prompt_lookup_max": 5, "prompt_lookup_min": 2}' --workloads extract --concurrency 1,4,8,16,32
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import os
import random
import statistics
import time
from dataclasses import dataclass

from benchmarks.workloads import QUESTIONS, VOCAB, ask, document
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.spec_config import SpeculativeConfig
from metrics.stats import IterationStats, SchedulerStats

FIRST = ("Alice", "Bruno", "Chiara", "Dmitri", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jonas")
LAST = ("Moreau", "Okafor", "Lindqvist", "Tanaka", "Ferreira", "Novak", "Schmidt", "Haddad", "Kowalski")
ITEMS = ("steel beams", "copper wire", "office chairs", "solar panels", "timber", "printer paper", "valves")


def contract(rng: random.Random, tokens: int) -> tuple[str, int]:
    """About `tokens` tokens of numbered clauses; returns (text, number of clauses)."""
    clauses = []
    n = 0
    while (
        sum(len(c) for c in clauses) < tokens * 2.8
    ):  # ~2.8 characters per token of these clauses on SmolLM2's tokenizer
        n += 1
        who = f"{rng.choice(FIRST)} {rng.choice(LAST)}"
        clauses.append(
            f"Clause {n}. {who} shall deliver {rng.randint(2, 900)} units of {rng.choice(ITEMS)} to the "
            f"{rng.choice(VOCAB)} {rng.choice(VOCAB)} depot by {rng.randint(1, 28)} "
            f"{rng.choice(('March', 'June', 'October'))} {rng.randint(2025, 2031)}, at "
            f"{rng.randint(10, 999)}.{rng.randint(10, 99)} euros per unit, or pay a penalty of "
            f"{rng.randint(1, 30)} percent."
        )
    return "\n".join(clauses), n


def extract_prompts(engine: AsyncEngine, streams: int, seed: int, doc_tokens: int) -> list[list[int]]:
    out = []
    for i in range(streams):
        rng = random.Random(seed * 1000 + i)
        text, n = contract(rng, doc_tokens)
        k = rng.randint(1, n)
        # The answer starts the quote (as an extraction prompt's answer format does): a 135M model then copies
        # the clause; left to itself it rambles about the question instead.
        messages = [
            {"role": "system", "content": "Answer from the contract only, quoting it exactly."},
            {"role": "user", "content": f"{text}\n\nQuote clause {k} word for word, then clause {k + 1}."},
            {"role": "assistant", "content": f"Clause {k}."},
        ]
        rendered = engine.tokenizer.apply_chat_template(messages, continue_final_message=True)
        out.append(engine.tokenizer.encode(rendered, add_special_tokens=False))
    return out


def free_prompts(engine: AsyncEngine, streams: int, seed: int, doc_tokens: int) -> list[list[int]]:
    rng = random.Random(seed)
    docs = [document(rng, doc_tokens, f"unique {seed} request {i}") for i in range(streams)]
    return [engine.tokenizer.encode(ask(d, QUESTIONS[i % len(QUESTIONS)])) for i, d in enumerate(docs)]


class Steps:
    """Counts decode steps, generated tokens and drafts: tokens per step is the speed-up a memory-bound step
    (whose cost hardly grows with its drafts) would give, whatever the machine's load."""

    def __init__(self) -> None:
        self.steps = self.tokens = self.drafted = self.accepted = 0

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        it = iteration_stats
        if it.num_generation_tokens:
            self.steps += 1
            self.tokens += it.num_generation_tokens
        if it.spec_decoding is not None:
            self.drafted += it.spec_decoding.num_draft_tokens
            self.accepted += it.spec_decoding.num_accepted_tokens

    def take(self) -> tuple[int, int, int, int]:
        out = (self.steps, self.tokens, self.drafted, self.accepted)
        self.steps = self.tokens = self.drafted = self.accepted = 0
        return out


class Arm:
    """The engine's stat logger: hands each step's stats to the counters of the arm being run."""

    def __init__(self, counters: dict[str, Steps]) -> None:
        self.counters = counters
        self.current = "off"

    def record(self, scheduler_stats: SchedulerStats, iteration_stats: IterationStats) -> None:
        self.counters[self.current].record(scheduler_stats, iteration_stats)


@dataclass(slots=True)
class Run:
    tokens_per_s: float
    outputs: list[list[int]]


async def one(engine: AsyncEngine, ids: list[int], params: SamplingParams) -> tuple[list[int], list[float]]:
    tokens: list[int] = []
    times: list[float] = []
    async for out in engine.generate(ids, params):
        now = time.perf_counter()
        for c in out.outputs:
            tokens += c.token_ids
            times += [now] * len(c.token_ids)
    return tokens, times


async def run(engine: AsyncEngine, prompts: list[list[int]], args: argparse.Namespace) -> Run:
    params = [
        SamplingParams(max_tokens=args.max_tokens, temperature=0.8, seed=i, ignore_eos=True)
        if args.seeded
        else SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
        for i in range(len(prompts))
    ]
    got = await asyncio.gather(*(one(engine, p, q) for p, q in zip(prompts, params, strict=True)))
    start = max(t[0] for _, t in got)
    end = max(t[-1] for _, t in got)
    n = sum(1 for _, times in got for t in times if t > start)
    assert engine.num_used_blocks() == 0
    return Run(n / (end - start) if end > start else float("nan"), [toks for toks, _ in got])


async def main_async(args: argparse.Namespace) -> None:
    levels = [int(c) for c in args.concurrency.split(",")]
    base = dict(
        device=args.device,
        dtype=args.dtype,
        max_num_seqs=max(levels),
        enable_prefix_caching=False,  # every round recomputes its prompts: decode is what is measured
        threads=args.threads,
        quantize_activations=args.quantize_activations,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    spec = SpeculativeConfig.from_json(args.spec)
    counters = {"off": Steps(), "on": Steps()}
    arm = Arm(counters)
    engine = AsyncEngine.from_config(EngineConfig(**base, speculative_config=spec, stat_loggers=[arm]))
    scheduler = engine._core.scheduler  # the bench's own engine: drafting is switched per arm, when idle
    drafter = scheduler.spec

    async def run_arm(name: str, prompts: list[list[int]]) -> Run:
        arm.current = name
        scheduler.spec = drafter if name == "on" else None
        return await run(engine, prompts, args)

    print(
        f"spec: {spec}; max_tokens {args.max_tokens}, {'seeded' if args.seeded else 'greedy'}; "
        f"load average {os.getloadavg()[0]:.2f}"
    )
    try:
        warm = free_prompts(engine, 2, 99, 200)
        for name in counters:
            await run_arm(name, warm)
        for c in counters.values():
            c.take()
        print(
            f"\n{'workload':>8} {'streams':>7} {'off tok/s':>10} {'on tok/s':>9} {'ratio':>6} {'min-max':>11} "
            f"{'accepted':>9} {'steps off/on':>12}"
        )
        for workload in args.workloads.split(","):
            build = extract_prompts if workload == "extract" else free_prompts
            for level in levels:
                rates: dict[str, list[float]] = {"off": [], "on": []}
                for r in range(args.rounds):
                    prompts = build(engine, level, args.seed + r, args.doc_tokens)
                    order = ["off", "on"] if r % 2 == 0 else ["on", "off"]
                    outs = {}
                    for name in order:
                        result = await run_arm(name, prompts)
                        rates[name].append(result.tokens_per_s)
                        outs[name] = result.outputs
                    assert outs["on"] == outs["off"], "speculation changed the output"
                ratios = [a / b for a, b in zip(rates["on"], rates["off"], strict=True)]
                off_steps = counters["off"].take()[0]
                on_steps, _, drafted, accepted = counters["on"].take()
                print(
                    f"{workload:>8} {level:>7} {statistics.median(rates['off']):>10.1f} "
                    f"{statistics.median(rates['on']):>9.1f} {statistics.median(ratios):>5.2f}x "
                    f"{min(ratios):>5.2f}-{max(ratios):.2f} {100 * accepted / max(1, drafted):>8.1f}% "
                    f"{off_steps / max(1, on_steps):>11.2f}x",
                    flush=True,
                )
        if drafter is not None and drafter.cost is not None:  # min_draft_acceptance "auto": what it measured
            cost = drafter.cost
            print(
                "measured draft threshold: "
                + ", ".join(f"{n} seqs {cost.threshold(n):.3f}" for n in (1, 4, 16))
            )
        print(f"load average {os.getloadavg()[0]:.2f}")
    finally:
        engine.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument(
        "--spec",
        default='{"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}',
        help="the --speculative-config JSON of the 'on' engine",
    )
    p.add_argument("--workloads", default="extract,free")
    p.add_argument("--concurrency", default="1,16")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--seeded", action="store_true", help="temperature 0.8 with a seed per stream")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--quantize-activations", default="none", choices=("none", "q8"), help="as brine serve's")
    p.add_argument("--kv-cache-dtype", default="auto", help="as brine serve's (auto, float16)")
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
