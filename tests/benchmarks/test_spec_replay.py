"""benchmarks/spec_replay.py counts a drafting policy's steps from an answer the way the engine drafts: an
answer that copies its prompt takes K + 1 tokens a step once drafting is trusted, one that copies nothing a
token a step, and the oracle never takes more steps than the engine's own choice."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # `benchmarks` is not an installed package

from benchmarks.spec_replay import AMX_COSTS, latest_longest, oracle, replay  # noqa: E402
from engine.ngram_proposer import NgramIndex  # noqa: E402
from engine.spec_config import SpeculativeConfig  # noqa: E402

K4 = SpeculativeConfig(num_speculative_tokens=4, prompt_lookup_max=4, prompt_lookup_min=2)


def test_a_copied_answer_takes_k_plus_one_tokens_a_step() -> None:
    prompt = list(range(100, 160))
    answer = prompt[:41]  # the first token comes from the prefill's step; then 40 in steps of 5
    steps, cost = replay(prompt + [7, 8], answer, K4, 0.07, latest_longest, AMX_COSTS)
    # the answer's first two tokens match nothing yet (the suffix [8, 100] never occurred): one plain step
    assert steps == 1 + 1 + 39 // 5 + (1 if 39 % 5 else 0), steps
    assert cost > steps  # drafted steps cost more than plain ones


def test_an_answer_with_nothing_to_copy_takes_a_step_per_token() -> None:
    prompt = list(range(100, 160))
    answer = list(range(500, 530))
    steps, cost = replay(prompt, answer, K4, 0.07, latest_longest, AMX_COSTS)
    assert steps == len(answer) and cost == len(answer)  # no lookup ever matched: no draft, plain steps


def test_the_oracle_drafts_from_the_occurrence_the_answer_follows() -> None:
    # [5, 1] occurred twice before; the engine drafts after the later (its match is longer: [0, 5, 1]), while
    # the answer follows the earlier
    prompt = [5, 1, 2, 3, 4, 5, 6, 0, 5, 1, 2, 7, 7, 7, 7, 0, 5]
    answer = [1, 2, 3, 4, 5, 6, 0, 5, 1, 2, 3, 4, 5, 6, 9, 9]
    assert latest_longest(*lookup(prompt, answer)) == [2, 7, 7, 7]
    assert oracle(*lookup(prompt, answer)) == [2, 3, 4, 5]
    engine_steps, _ = replay(prompt, answer, K4, 0.07, latest_longest, AMX_COSTS)
    oracle_steps, _ = replay(prompt, answer, K4, 0.07, oracle, AMX_COSTS)
    assert (engine_steps, oracle_steps) == (6, 5)


def lookup(prompt: list[int], answer: list[int]) -> tuple[NgramIndex, list[int], int, int, list[int]]:
    """A proposer's arguments at the answer's second token (its first came from the prefill)."""
    return NgramIndex(2), prompt + answer[:1], 4, 4, answer[1:]
