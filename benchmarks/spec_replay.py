"""What drafting from the request's own text can do on the extraction workload, counted offline.

Greedy output does not change with speculation, so a drafting policy's decode steps can be counted from the
answers alone: the engine answers spec_decode_bench's extraction prompts once (greedy, no speculation), then
each policy replays every answer, token by token, through the engine's own proposer and adaptation
(engine.ngram_proposer, engine.spec_decode), drafting at each step what it would have drafted and accepting the
drafts' longest prefix that equals the answer. With what a step of K drafts costs over a plain one
(`--costs`, from `benchmarks/spec_step_cost.py --batch 1`), each answer's speed-up is its tokens over the
steps' summed cost: the bench's tok/s ratio without the machine's noise (it agrees with spec_decode_bench
within ~0.05x on the same prompts). The "oracle" policy drafts, at each step, from whichever earlier occurrence
of the suffix agrees longest with the answer: a bound on picking among the n-gram's candidates.

    .venv/bin/python benchmarks/spec_replay.py --prompts 16
    .venv/bin/python benchmarks/spec_replay.py --answers /tmp/answers.json --costs 1,1.08,1.16,1.22,1.28,1.35,1.41,1.49,1.57
"""

from __future__ import annotations

if __package__ in (None, ""):  # run as a script: make `benchmarks` importable
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import argparse
import asyncio
import json
import statistics
from collections.abc import Callable
from pathlib import Path

from benchmarks.spec_decode_bench import extract_prompts, one
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.ngram_proposer import NgramIndex
from engine.sampling_params import SamplingParams
from engine.spec_config import SpeculativeConfig
from engine.spec_decode import RequestSpec, SpecDecoder

# A step of K drafts' cost over a plain step, K = 0..8: one sequence over 2,000 cached tokens, AMX Xeon,
# session 28 (spec_step_cost.py --batch 1 --draft 0,1,2,3,4,6,8; 5 and 7 interpolated).
AMX_COSTS = (1.0, 1.08, 1.16, 1.22, 1.28, 1.35, 1.41, 1.49, 1.57)
Proposer = Callable[[NgramIndex, list[int], int, int, list[int]], list[int]]


def latest_longest(index: NgramIndex, tokens: list[int], k: int, max_n: int, answer: list[int]) -> list[int]:
    return index.propose(tokens, k, max_n)  # the engine's own


def oracle(index: NgramIndex, tokens: list[int], k: int, max_n: int, answer: list[int]) -> list[int]:
    index.extend(tokens)
    found = index.ends.get(tuple(tokens[len(tokens) - index.n :]), [])
    best: list[int] = []
    best_agree = -1
    for end in found:
        if end >= len(tokens):
            continue
        draft = tokens[end : min(end + k, len(tokens))]
        agree = 0
        while agree < len(draft) and agree < len(answer) and draft[agree] == answer[agree]:
            agree += 1
        if agree > best_agree:
            best, best_agree = draft, agree
    return best


def replay(
    prompt: list[int], answer: list[int], config: SpeculativeConfig, threshold: float, propose: Proposer,
    costs: tuple[float, ...],
) -> tuple[int, float]:  # fmt: skip
    """(steps, summed step cost) of decoding `answer` after `prompt` under `config` at a fixed threshold."""
    decoder = SpecDecoder(config, 1 << 30)
    decoder.threshold = threshold
    state = RequestSpec(None, NgramIndex(config.prompt_lookup_min))  # type: ignore[arg-type]
    tokens = prompt + answer[:1]  # the prefill's step samples the first token
    i, steps, cost = 1, 1, 1.0
    while i < len(answer):
        left = len(answer) - i - 1  # as SpecDecoder.propose: never a draft past max_tokens
        drafts: list[int] = []
        if left >= 1:
            drafts = decoder.draft(
                state,
                left,
                lambda k, known=tokens, rest=answer[i:]: propose(
                    state.index, known, k, config.prompt_lookup_max, rest
                ),
            )
        accepted = 0
        while accepted < len(drafts) and drafts[accepted] == answer[i + accepted]:
            accepted += 1
        if drafts:
            decoder.adapt(state, len(drafts), accepted)
        cost += costs[min(len(drafts), len(costs) - 1)]
        tokens += answer[i : i + accepted + 1]
        i += accepted + 1
        steps += 1
    return steps, cost


async def answers(count: int, doc_tokens: int, max_tokens: int) -> list[dict]:
    engine = AsyncEngine.from_config(EngineConfig(enable_prefix_caching=False))
    out = []
    try:
        for seed in range(count):  # the bench's round r uses seed r
            prompt = extract_prompts(engine, 1, seed, doc_tokens)[0]
            params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
            tokens, _ = await one(engine, prompt, params)
            out.append({"prompt": prompt, "answer": tokens, "text": engine.tokenizer.decode(tokens)})
    finally:
        engine.shutdown()
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompts", type=int, default=16)
    p.add_argument("--doc-tokens", type=int, default=2000)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument(
        "--answers", type=Path, help="a JSON of answers to replay (made and saved here if missing)"
    )
    p.add_argument("--costs", default=",".join(map(str, AMX_COSTS)), help="a step's cost at K = 0, 1, ..")
    args = p.parse_args()
    if args.answers is not None and args.answers.exists():
        data = json.loads(args.answers.read_text())
    else:
        data = asyncio.run(answers(args.prompts, args.doc_tokens, args.max_tokens))
        if args.answers is not None:
            args.answers.write_text(json.dumps(data))
    costs = tuple(float(c) for c in args.costs.split(","))
    print(f"{len(data)} answers of {args.max_tokens} tokens; step costs {costs}")
    print(f"{'policy':>44} {'tokens/step':>11} {'speed-up median':>15} {'first 3':>8}")
    for label, k, max_n, threshold, propose in (
        ("K=4, lookup 2..4, threshold 0.3", 4, 4, 0.3, latest_longest),
        ("K=4, lookup 2..4, threshold 0.07", 4, 4, 0.07, latest_longest),
        ("K=8, lookup 2..4, threshold 0.07", 8, 4, 0.07, latest_longest),
        ("K=8, lookup 2..16, threshold 0.07", 8, 16, 0.07, latest_longest),
        ("oracle candidate, K=4, threshold 0.07", 4, 4, 0.07, oracle),
        ("oracle candidate, K=8, threshold 0.07", 8, 4, 0.07, oracle),
    ):
        config = SpeculativeConfig(num_speculative_tokens=k, prompt_lookup_max=max_n, prompt_lookup_min=2)
        runs = [replay(d["prompt"], d["answer"], config, threshold, propose, costs) for d in data]
        per_step = sum(len(d["answer"]) for d in data) / sum(steps for steps, _ in runs)
        speedups = [len(d["answer"]) / cost for d, (_, cost) in zip(data, runs, strict=True)]
        print(
            f"{label:>44} {per_step:>11.2f} {statistics.median(speedups):>14.2f}x "
            f"{statistics.median(speedups[:3]):>7.2f}x"
        )
    for seed, d in enumerate(data):
        print(f"answer {seed}: {d['text'][:160]!r}")


if __name__ == "__main__":
    main()
