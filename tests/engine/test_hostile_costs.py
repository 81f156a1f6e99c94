"""Per-token costs that a hostile request must not be able to grow: stop_token_ids are read as a set built
once per sequence, by the scheduler's stop check and by the sampler's min_tokens mask.

A list that counts how often it is read stands in for a huge `stop_token_ids`: the engine may read it when a
sequence is made, never per token.
"""

from __future__ import annotations

import torch
from engine_fakes import FakeRunner, make_core, run_to_completion

from engine.outputs import ScheduledRequest
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams


class CountingList(list):
    """A list that counts every read of its items (iteration and membership tests)."""

    def __init__(self, items) -> None:
        super().__init__(items)
        self.reads = 0

    def __iter__(self):
        self.reads += 1
        return super().__iter__()

    def __contains__(self, item) -> bool:
        self.reads += 1
        return super().__contains__(item)


def test_the_scheduler_stop_check_reads_stop_token_ids_once_per_sequence_not_per_token():
    ids = CountingList(range(1000, 3000))  # never sampled by the fake runner (its vocabulary is smaller)
    core = make_core(FakeRunner(num_blocks=64))
    params = SamplingParams(n=3, max_tokens=20, ignore_eos=True, stop_token_ids=ids, temperature=0)
    core.add_request("r", [1, 2, 3], params)
    reads_after_add = ids.reads
    outputs = run_to_completion(core)
    assert sum(len(c.token_ids) for o in outputs for c in o.outputs) == 60
    assert reads_after_add <= 1 + params.n  # the request's params and each child's copy: once each
    assert ids.reads == reads_after_add, (
        f"stop_token_ids read {ids.reads - reads_after_add} times while running"
    )


def test_the_sampler_min_tokens_mask_reads_stop_token_ids_once_per_sequence():
    ids = CountingList([7, 9])
    params = SamplingParams(temperature=0.0, min_tokens=50, stop_token_ids=ids)
    built = ids.reads
    sampler = Sampler(torch.device("cpu"), 32)
    logits = torch.full((1, 32), -5.0)
    logits[0, 7], logits[0, 9], logits[0, 2], logits[0, 11] = 10.0, 9.5, 9.0, 8.0
    for step in range(10):
        tokens = [1, 5, *([4] * step)]
        req = ScheduledRequest(
            "r",
            tokens[-1:],
            len(tokens) - 1,
            [0],
            True,
            params,
            tokens,
            2,
            step,
            eos_token_ids=frozenset({2}),
        )
        assert sampler(logits, [req]).token_ids.tolist() == [11]  # stop tokens and EOS stay masked
    assert ids.reads == built, "the sampler rebuilt the stop set from the list on every step"
