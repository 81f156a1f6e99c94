"""A victim's inter-token latency beside one stream constrained by an ambiguous grammar, in one engine.

Issue 28: a grammar whose mask grows with its output (ambiguous EBNF: `s ::= s s | ...`) slowed every other
stream's steps, because masks ran on the step thread after the forward. Here one greedy victim stream decodes
alone, then beside such a stream; the report gives the victim's median and p90 gap between tokens in each
phase and their ratio, and how the constrained stream ended (it should fail alone once its mask is over the
per-token budget, `--grammar-mask-budget-ms`). In process (no HTTP), default model:

    .venv/bin/python -m benchmarks.grammar_stall_bench --tokens 96 --rounds 3

It runs on older trees as well (only `AsyncEngine` and `SamplingParams.structured` are used), which is how
the before / after figures in docs/benchmarks.md were taken: the same command in a worktree of the older commit.
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import statistics
import time

from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputSpec

# Every letter run parses in exponentially many ways; xgrammar's mask cost grows with the output (~1 ms at
# 10 tokens, ~30 ms at 40 on a 2-core EPYC).
AMBIGUOUS = 'root ::= (s)*\ns ::= s s | "a" | [a-z]+'
VICTIM_PROMPT = [1, 504, 3458, 282, 4296, 30, 216] * 4


async def _victim(engine: AsyncEngine, tokens: int) -> list[float]:
    params = SamplingParams(max_tokens=tokens, temperature=0.0, ignore_eos=True)
    stamps: list[float] = []
    async for out in engine.generate(VICTIM_PROMPT, params):
        stamps += [time.perf_counter()] * len(out.outputs[0].token_ids)
    return [b - a for a, b in zip(stamps[1:], stamps[2:], strict=False)]  # from the 2nd token on


async def _constrained(engine: AsyncEngine, tokens: int) -> str:
    params = SamplingParams(
        max_tokens=tokens * 4,
        min_tokens=tokens * 4,
        temperature=0.0,
        structured=StructuredOutputSpec("grammar", AMBIGUOUS),
    )
    n = 0
    try:
        async for out in engine.generate([1, 504, 3458], params):
            n += len(out.outputs[0].token_ids)
            if out.finished:
                reason = out.outputs[0].finish_reason
                return f"finished ({reason}) after {n} tokens" + (f": {out.error}" if out.error else "")
    except asyncio.CancelledError:
        return f"still running after {n} tokens"
    except Exception as exc:  # refused up front (a 400 over HTTP)
        return f"refused: {exc}"
    return f"ended after {n} tokens"


def _stats(gaps: list[float]) -> tuple[float, float]:
    gaps = sorted(gaps)
    return statistics.median(gaps), gaps[int(0.9 * (len(gaps) - 1))]


async def run(tokens: int, rounds: int, budget_ms: float | None) -> None:
    config = EngineConfig()
    if budget_ms is not None:
        config.grammar_mask_budget_ms = budget_ms  # type: ignore[attr-defined]
    engine = AsyncEngine.from_config(config, prestart_grammar_workers=True)  # as brine serve
    try:
        await _victim(engine, 8)  # warm-up
        alone: list[float] = []
        beside: list[float] = []
        endings: list[str] = []
        for _ in range(rounds):
            alone += await _victim(engine, tokens)
            other = asyncio.ensure_future(_constrained(engine, tokens))
            await asyncio.sleep(0.5)  # its compile and first tokens
            beside += await _victim(engine, tokens)
            other.cancel()
            endings.append(await other)
        (am, a90), (bm, b90) = _stats(alone), _stats(beside)
        print(f"victim alone : median {am * 1e3:.1f} ms, p90 {a90 * 1e3:.1f} ms ({len(alone)} gaps)")
        print(f"victim beside: median {bm * 1e3:.1f} ms, p90 {b90 * 1e3:.1f} ms ({len(beside)} gaps)")
        print(f"beside / alone: median {bm / am:.2f}x, p90 {b90 / a90:.2f}x")
        for e in endings:
            print(f"ambiguous stream: {e}")
    finally:
        engine.shutdown()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=96, help="victim tokens per phase")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--budget-ms", type=float, default=None, help="grammar_mask_budget_ms (newer trees)")
    args = parser.parse_args()
    asyncio.run(run(args.tokens, args.rounds, args.budget_ms))


if __name__ == "__main__":
    main()
