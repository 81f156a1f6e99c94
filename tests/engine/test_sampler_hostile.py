"""Sampler: a row left with nothing to sample gets INVALID_TOKEN, never an id outside the vocabulary, and
the rows beside it get exactly the tokens and logprobs they get alone."""

from __future__ import annotations

import math

import pytest
import torch

from engine.outputs import ScheduledRequest
from engine.sampler import INVALID_TOKEN, Sampler, inverse_cdf
from engine.sampling_params import SamplingParams

V = 40
EOS = 2


def _req(params: SamplingParams, rid: str, grammar: object = None, n_out: int = 0) -> ScheduledRequest:
    tokens = [1, 5, 6] + [7] * n_out
    return ScheduledRequest(
        rid,
        tokens[-1:],
        len(tokens) - 1,
        [0],
        True,
        params,
        tokens,
        3,
        n_out,
        grammar,
        eos_token_ids=frozenset({EOS}),
    )


def _sampler() -> Sampler:
    return Sampler(torch.device("cpu"), V)


class OnlyEos:
    """A grammar that allows nothing but EOS (as guided_choice does once its choice is written)."""

    active = True

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        bitmask[row] = 0
        bitmask[row, EOS // 32] = 1 << (EOS % 32)


def _rows(seed: int) -> torch.Tensor:
    return torch.randn(4, V, generator=torch.Generator().manual_seed(seed)) * 3


BROKEN_ROWS = {
    "nan": lambda row: row.index_fill_(0, torch.tensor([3]), float("nan")),
    "plus-inf": lambda row: row.index_fill_(0, torch.tensor([9]), float("inf")),
    "all-masked": lambda row: row.fill_(float("-inf")),
    "all-nan": lambda row: row.fill_(float("nan")),
}


@pytest.mark.parametrize("broken", sorted(BROKEN_ROWS))
@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0, logprobs=3),
        SamplingParams(temperature=1.0, logprobs=3),
        SamplingParams(temperature=0.7, top_p=0.9, top_k=5, min_p=0.1, seed=11, logprobs=3),
    ],
    ids=["greedy", "sampled", "filtered-seeded"],
)
def test_a_row_with_no_distribution_gets_the_invalid_token_and_its_neighbours_do_not_change(broken, params):
    logits = _rows(1)
    innocent = [
        SamplingParams(temperature=0.0, logprobs=2),
        SamplingParams(temperature=0.8, seed=5, logprobs=2),
        SamplingParams(temperature=0.8, seed=6),
    ]
    alone = [_sampler()(logits[i : i + 1].clone(), [_req(p, f"i{i}")]) for i, p in enumerate(innocent)]
    batch = logits.clone()
    BROKEN_ROWS[broken](batch[3])
    reqs = [_req(p, f"i{i}") for i, p in enumerate(innocent)] + [_req(params, "bad")]
    out = _sampler()(batch, reqs)
    assert out.token_ids[3].item() == INVALID_TOKEN
    assert out.token_ids[:3].tolist() == [a.token_ids.item() for a in alone]
    assert out.logprob_rows == [0, 1, 3] and out.logprobs is not None
    for j, a in enumerate(alone[:2]):
        assert a.logprobs is not None
        assert out.logprobs.chosen[j].item() == a.logprobs.chosen[0].item()
        assert out.logprobs.top_ids[j, :2].tolist() == a.logprobs.top_ids[0].tolist()


def test_every_valid_row_gets_an_id_inside_the_vocabulary():
    """A repetition penalty whose division overflowed (the engine-kill request): x / 0 = inf in float32."""
    logits = _rows(2)
    params = SamplingParams(temperature=1.0)
    params.repetition_penalty = 1e-300  # past validation: the sampler is the last line of defence
    out = _sampler()(logits, [_req(params, str(i)) for i in range(4)])
    ids = out.token_ids.tolist()
    assert all(t == INVALID_TOKEN or 0 <= t < V for t in ids)
    assert INVALID_TOKEN in ids  # 1e-300 is 0 in float32: every seen positive logit became inf


def test_min_tokens_yields_to_a_grammar_that_can_only_end():
    """The grammar allows only EOS and min_tokens masks it: the grammar wins (the output ends complete and
    short) rather than leaving the row nothing to sample. A free row beside it keeps min_tokens."""
    logits = _rows(3)
    logits[:, EOS] = 50.0
    constrained = _req(SamplingParams(temperature=1.0, min_tokens=5), "c", OnlyEos(), n_out=1)
    free = _req(SamplingParams(temperature=0.0, min_tokens=5), "f", n_out=1)
    out = _sampler()(logits, [constrained, free])
    assert out.token_ids[0].item() == EOS
    assert out.token_ids[1].item() == logits[1].index_fill(0, torch.tensor([EOS]), -math.inf).argmax().item()


def test_min_tokens_still_binds_a_grammar_that_allows_more():
    class EosOrSeven(OnlyEos):
        def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
            super().fill_mask(bitmask, row)
            bitmask[row, 0] |= 1 << 7

    logits = _rows(4)[:1]
    logits[:, EOS] = 50.0
    out = _sampler()(logits, [_req(SamplingParams(temperature=1.0, min_tokens=5), "c", EosOrSeven())])
    assert out.token_ids.tolist() == [7]


def test_inverse_cdf_never_answers_the_row_width():
    probs = torch.tensor([[0.2, 0.8, 0.0], [math.nan] * 3, [0.0] * 3])
    u = torch.tensor([[0.5], [0.5], [0.5]])
    assert inverse_cdf(probs, u).tolist() == [1, INVALID_TOKEN, INVALID_TOKEN]


def test_a_grammar_whose_mask_cannot_be_filled_fails_its_row_alone():
    """A matcher that raises is its own request's fault: its row gets INVALID_TOKEN, the constrained and free
    rows beside it get the tokens they get alone."""

    class Broken(OnlyEos):
        def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
            raise RuntimeError("matcher state is corrupt")

    logits = _rows(5)[:3]
    reqs = [
        _req(SamplingParams(temperature=0.0), "ok", OnlyEos()),
        _req(SamplingParams(temperature=0.0), "broken", Broken()),
        _req(SamplingParams(temperature=0.0), "free"),
    ]
    out = _sampler()(logits.clone(), reqs)
    assert out.token_ids.tolist() == [EOS, INVALID_TOKEN, logits[2].argmax().item()]
