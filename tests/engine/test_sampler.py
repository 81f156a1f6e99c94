"""Sampler: greedy, seeded draws, top-k / top-p / min-p, penalties, min_tokens and raw logprobs."""

from __future__ import annotations

import math

import pytest
import torch

from engine import sampler as sampler_module
from engine.outputs import ScheduledRequest
from engine.sampler import Sampler, inverse_cdf, mix_seed, top_k_top_p
from engine.sampling_params import SamplingParams

V = 32


EOS = frozenset({2})  # the scheduler's EOS set, which each request brings the sampler


def _req(params: SamplingParams, tokens=(1, 2, 3), num_prompt: int = 3, rid: str = "r") -> ScheduledRequest:
    tokens = list(tokens)
    n_out = len(tokens) - num_prompt
    return ScheduledRequest(
        rid, tokens[-1:], len(tokens) - 1, [0], True, params, tokens, num_prompt, n_out, eos_token_ids=EOS
    )


def _sampler() -> Sampler:
    return Sampler(torch.device("cpu"), V)


def _logits(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, V, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_is_argmax():
    logits = _logits(5)
    out = _sampler()(logits, [_req(SamplingParams(temperature=0.0)) for _ in range(5)])
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprobs is None


def test_top_k_one_equals_greedy():
    logits = _logits(8, 1)
    reqs = [_req(SamplingParams(temperature=1.3, top_k=1)) for _ in range(8)]
    assert _sampler()(logits, reqs).token_ids.tolist() == logits.argmax(-1).tolist()


def test_greedy_and_sampled_rows_land_in_their_own_places():
    logits = _logits(6, 7)  # every row has its own argmax
    params = [SamplingParams(temperature=0.0), SamplingParams(temperature=0.9, top_k=1, logprobs=1)] * 3
    out = _sampler()(logits, [_req(p, rid=str(i)) for i, p in enumerate(params)])
    assert out.token_ids.tolist() == logits.argmax(-1).tolist()
    assert out.logprob_rows == [1, 3, 5]
    raw = torch.log_softmax(logits, dim=-1)
    torch.testing.assert_close(out.logprobs.top_vals[:, 0], raw[[1, 3, 5]].max(-1).values)


def test_top_logprobs_are_capped_by_the_vocabulary():
    logits = torch.tensor([[0.5, 2.0, -1.0]])
    out = Sampler(torch.device("cpu"), 3)(logits, [_req(SamplingParams(temperature=0.0, logprobs=20))])
    assert out.logprobs.top_ids.tolist() == [[1, 0, 2]]


def test_tiny_top_p_equals_greedy():
    logits = _logits(8, 2)
    reqs = [_req(SamplingParams(temperature=1.0, top_p=1e-6)) for _ in range(8)]
    assert _sampler()(logits, reqs).token_ids.tolist() == logits.argmax(-1).tolist()


def _seeded_run(seed: int, position: int, batch_size: int, steps: int = 12) -> list[int]:
    """Draw `steps` tokens for a seeded request placed at `position` among unseeded companions."""
    sampler, logits = _sampler(), _logits(1, 3).expand(batch_size, V).clone()
    tokens = []
    for step in range(steps):
        reqs = [_req(SamplingParams(temperature=1.0), rid=f"o{i}") for i in range(batch_size)]
        mine = _req(SamplingParams(temperature=1.0, seed=seed), tokens=[1, 2, 3] + tokens)
        reqs[position] = mine
        torch.manual_seed(1000 + step * 7 + batch_size)  # the companions' noise changes with the batch
        tokens.append(sampler(logits, reqs).token_ids[position].item())
        assert mine.num_output_tokens == step
    return tokens


def test_same_seed_same_tokens_regardless_of_batch():
    alone = _seeded_run(seed=42, position=0, batch_size=1)
    assert _seeded_run(seed=42, position=3, batch_size=5) == alone
    assert _seeded_run(seed=42, position=1, batch_size=2) == alone
    assert _seeded_run(seed=43, position=0, batch_size=1) != alone
    assert len(set(alone)) > 1  # a real draw, not a constant


def test_the_draw_never_picks_a_token_without_probability():
    probs = torch.tensor([[0.0, 0.5, 0.0, 0.0, 0.5, 0.0], [0.0, 0.0, 1e-30, 0.0, 0.0, 0.0]])
    below_one = 1.0 - 2.0**-24  # the largest float32 uniform_ gives
    for u, want in ((0.0, [1, 2]), (0.49, [1, 2]), (0.5, [4, 2]), (below_one, [4, 2]), (1.0, [4, 2])):
        got = inverse_cdf(probs, torch.full((2, 1), u))
        assert got.tolist() == want, u  # u = 1 stands for u x total rounding up to the total
    # Every cut point of a fine grid lands on a token that has probability.
    many = inverse_cdf(probs[:1].expand(1001, 6), torch.linspace(0, below_one, 1001)[:, None])
    assert set(many.tolist()) == {1, 4} and (many == 1).sum().item() in (500, 501)


def test_mix_seed_spreads_nearby_inputs():
    values = {mix_seed(s, i) for s in range(20) for i in range(20)}
    assert len(values) == 400 and all(0 <= v < 2**63 for v in values)


def _frequencies(params: SamplingParams, probs: list[float], n: int = 4000) -> list[float]:
    logits = torch.tensor(probs).log().expand(n, len(probs)).clone()
    torch.manual_seed(0)
    sampler = Sampler(torch.device("cpu"), len(probs))
    tokens = sampler(logits, [_req(params) for _ in range(n)]).token_ids
    return (torch.bincount(tokens, minlength=len(probs)).float() / n).tolist()


PROBS = [0.4, 0.3, 0.2, 0.1]


def test_plain_sampling_follows_the_distribution():
    freq = _frequencies(SamplingParams(temperature=1.0), PROBS)
    assert all(abs(f - p) < 0.03 for f, p in zip(freq, PROBS, strict=True))


def test_temperature_sharpens_and_flattens():
    cold = _frequencies(SamplingParams(temperature=0.5), PROBS)
    hot = _frequencies(SamplingParams(temperature=2.0), PROBS)
    want_cold = [p**2 / sum(q**2 for q in PROBS) for p in PROBS]
    want_hot = [math.sqrt(p) / sum(math.sqrt(q) for q in PROBS) for p in PROBS]
    assert all(abs(f - p) < 0.03 for f, p in zip(cold, want_cold, strict=True))
    assert all(abs(f - p) < 0.03 for f, p in zip(hot, want_hot, strict=True))


@pytest.mark.parametrize(
    ("params", "kept"),
    [
        (SamplingParams(top_k=2), [0, 1]),
        (SamplingParams(top_p=0.5), [0, 1]),  # 0.4 < 0.5, so the second token is still needed
        (SamplingParams(top_p=0.75), [0, 1, 2]),
        (SamplingParams(min_p=0.45), [0, 1, 2]),  # keeps p >= 0.45 * 0.4
        (SamplingParams(min_p=0.8), [0]),
        (SamplingParams(top_k=3, top_p=0.5), [0, 1]),
    ],
)
def test_filters_keep_exactly_the_expected_tokens(params, kept):
    freq = _frequencies(params, PROBS)
    assert {i for i, f in enumerate(freq) if f > 0} == set(kept)
    total = sum(PROBS[i] for i in kept)
    assert all(abs(freq[i] - PROBS[i] / total) < 0.03 for i in kept)


def test_penalties_change_logits_as_specified():
    logits = torch.tensor([[4.0, -1.0, 2.0, 1.0, 0.5, 3.0]])
    # prompt [0, 1], output [2, 2, 3]
    req = _req(
        SamplingParams(repetition_penalty=2.0, frequency_penalty=0.5, presence_penalty=0.25),
        tokens=[0, 1, 2, 2, 3],
        num_prompt=2,
    )
    out = Sampler(torch.device("cpu"), 6)._apply_penalties(logits.clone(), [req])
    want = [
        4.0 / 2,  # prompt token, positive: divided
        -1.0 * 2,  # prompt token, negative: multiplied
        2.0 / 2 - 0.5 * 2 - 0.25,  # output twice: repetition, then frequency x2 and presence once
        1.0 / 2 - 0.5 - 0.25,
        0.5,  # never seen
        3.0,
    ]
    torch.testing.assert_close(out[0], torch.tensor(want))


def test_penalties_touch_only_seen_tokens_with_the_whole_row_arithmetic():
    # The CPU path changes only the (row, token) logits a penalty concerns; every value must have the bits
    # the whole-row formula gives (the CUDA path's), and the rows without a penalty stay as they were.
    g = torch.Generator().manual_seed(9)
    vocab, rows = 200, 6
    logits = torch.randn(rows, vocab, generator=g) * 4
    logits[2, 5] = float("-inf")
    settings = [
        SamplingParams(repetition_penalty=1.3, frequency_penalty=0.4, presence_penalty=0.2),
        SamplingParams(temperature=0.7),  # no penalty
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(frequency_penalty=-0.5, presence_penalty=1.5),
        SamplingParams(repetition_penalty=1.1, presence_penalty=0.3),
        SamplingParams(temperature=0.0),
    ]
    reqs = []
    for i, params in enumerate(settings):
        tokens = torch.randint(0, vocab, (40,), generator=g).tolist() + [5, 5, 7]
        reqs.append(_req(params, tokens=tokens, num_prompt=25, rid=str(i)))
    got = Sampler(torch.device("cpu"), vocab)._apply_penalties(logits.clone(), reqs)
    want = logits.clone()
    for i, r in enumerate(reqs):
        q = r.sampling_params
        counts, seen = torch.zeros(vocab), torch.zeros(vocab, dtype=torch.bool)
        for t in r.all_token_ids[r.num_prompt_tokens :]:
            counts[t] += 1
        if q.repetition_penalty != 1.0:
            seen[r.all_token_ids] = True
        rep = torch.tensor(q.repetition_penalty)
        row = torch.where(seen, torch.where(want[i] > 0, want[i] / rep, want[i] * rep), want[i])
        want[i] = (
            row
            - torch.tensor(q.frequency_penalty) * counts
            - torch.tensor(q.presence_penalty) * (counts > 0).float()
        )
    assert torch.equal(got, want)
    assert torch.equal(got[1], logits[1]) and torch.equal(got[5], logits[5])


def test_frequency_and_presence_ignore_prompt_tokens():
    logits = torch.zeros(1, 4)
    req = _req(SamplingParams(frequency_penalty=1.0, presence_penalty=1.0), tokens=[1, 1, 1, 2], num_prompt=3)
    out = Sampler(torch.device("cpu"), 4)._apply_penalties(logits.clone(), [req])
    assert out[0].tolist() == [0.0, 0.0, -2.0, 0.0]


def test_penalty_steers_greedy_away_from_repeats():
    logits = torch.tensor([[1.0, 5.0, 4.9, 0.0]])
    sampler = Sampler(torch.device("cpu"), 4)
    plain = _req(SamplingParams(temperature=0.0), tokens=[0, 1, 1], num_prompt=1)
    penalized = _req(SamplingParams(temperature=0.0, frequency_penalty=0.2), tokens=[0, 1, 1], num_prompt=1)
    rows = sampler(logits.expand(2, 4).clone(), [plain, penalized]).token_ids.tolist()
    assert rows == [1, 2]


def test_min_tokens_masks_eos_and_stop_tokens():
    logits = torch.full((3, V), -5.0)
    logits[:, 2] = 10.0  # EOS
    logits[:, 7] = 9.0  # a stop token
    logits[:, 11] = 8.0
    sampler = _sampler()
    early = _req(
        SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=[7]), tokens=[1, 5, 6], num_prompt=2
    )
    done = _req(
        SamplingParams(temperature=0.0, min_tokens=1, stop_token_ids=[7]), tokens=[1, 5, 6], num_prompt=2
    )
    no_eos = _req(SamplingParams(temperature=0.0, min_tokens=3, ignore_eos=True), tokens=[1, 5], num_prompt=2)
    assert sampler(logits, [early, done, no_eos]).token_ids.tolist() == [11, 2, 2]


def test_logprobs_are_raw_and_sorted():
    logits = _logits(3, 5)
    reqs = [
        _req(SamplingParams(temperature=0.7, logprobs=3, repetition_penalty=1.5, seed=1)),
        _req(SamplingParams(temperature=0.0)),
        _req(SamplingParams(temperature=0.0, logprobs=0, presence_penalty=1.0)),
    ]
    out = _sampler()(logits, reqs)
    raw = torch.log_softmax(logits, dim=-1)
    assert out.logprob_rows == [0, 2]
    tokens = out.token_ids.tolist()
    torch.testing.assert_close(out.logprobs.chosen, raw[[0, 2], [tokens[0], tokens[2]]])
    top_vals, top_ids = raw[0].topk(3)
    assert out.logprobs.top_ids[0].tolist() == top_ids.tolist()
    torch.testing.assert_close(out.logprobs.top_vals[0], top_vals)


def _kept_by_sorting(row: torch.Tensor, k: int, p: float) -> set[int]:
    """The reference: the whole row sorted, k-th value and top-p's last kept probability as thresholds."""
    vocab = row.numel()
    if k < vocab:
        row = row.masked_fill(row < row.sort(descending=True).values[k - 1], float("-inf"))
    if p < 1.0:
        probs = row.softmax(-1)
        ranked = probs.sort(descending=True).values
        before = ranked.cumsum(-1) - ranked
        last = next((j for j in range(vocab) if before[j] >= p), vocab) - 1
        row = row.masked_fill(probs < ranked[last], float("-inf"))
    return set(torch.isfinite(row).nonzero().view(-1).tolist())


def _cut(logits: torch.Tensor, ks: list[int], ps: list[float]) -> list[set[int]]:
    out = top_k_top_p(
        logits, ks, ps, torch.tensor(ks, dtype=torch.float32)[:, None], torch.tensor(ps)[:, None]
    )
    return [set(torch.isfinite(r).nonzero().view(-1).tolist()) for r in out]


def test_top_k_and_top_p_cut_from_candidates_as_a_whole_sort_would(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(sampler_module, "TOP_P_CANDIDATES", 64)  # the cut from candidates, and past them
    vocab, g = 3000, torch.Generator().manual_seed(5)
    # Peaked rows (top-p reached within 64 tokens), flat ones (not: the whole row is sorted), and rows rounded
    # to bfloat16, whose logits tie often.
    logits = torch.cat([
        torch.randn(4, vocab, generator=g) * 6,
        torch.randn(4, vocab, generator=g) * 0.2,
        (torch.randn(4, vocab, generator=g) * 3).to(torch.bfloat16).float(),
    ])  # fmt: skip
    ks = [vocab, 40, vocab, 700, vocab, 5, 2000, vocab, 40, vocab, 10, vocab]
    ps = [0.9, 2.0, 0.5, 0.95, 0.9, 2.0, 0.3, 0.99, 0.8, 0.7, 2.0, 2.0]
    batched = _cut(logits, ks, ps)
    for i in range(len(ks)):
        want = _kept_by_sorting(logits[i], ks[i], ps[i])
        assert batched[i] == want, i
        # A row's cut is its own: alone, or beside rows that make the candidates wider.
        assert _cut(logits[i : i + 1], ks[i : i + 1], ps[i : i + 1])[0] == want, i
        assert _cut(logits[[i, 6]], [ks[i], 2000], [ps[i], 0.3])[0] == want, i
    assert len(batched[4]) > 64 and len(batched[11]) == vocab  # the flat row needed more than the candidates


def test_tied_logits_are_kept_or_dropped_together():
    row = torch.tensor([[3.0, 1.0, 1.0, 1.0, 0.0, -1.0]])
    assert _cut(row, [2], [2.0]) == [{0, 1, 2, 3}]  # the 2nd largest ties with two more: all stay
    probs = row.softmax(-1)[0]
    p = (probs[0] + probs[1]).item() - 1e-4  # reached within the tie: the tie still stays whole
    assert _cut(row, [6], [p]) == [{0, 1, 2, 3}]


def test_tied_alternatives_come_in_token_order_whatever_k_the_step_asks_for():
    """A request's top alternatives must not depend on its neighbours: the step asks for the largest k any of
    them wants, and topk alone orders (and, across the k-th place, picks) equal values by how it is called.
    Ties come first by token id, and the lowest ids win the last places, so every k is a prefix of a larger
    one and a row gets the same list alone or beside others."""
    from engine.sampler import token_logprobs

    logits = torch.full((1, 40), -5.0)
    logits[0, [31, 7, 19]] = 2.0  # three tied best
    logits[0, [25, 3]] = 1.0  # two tied next
    wide = token_logprobs(logits, torch.tensor([7]), 20)
    assert wide.top_ids[0, :5].tolist() == [7, 19, 31, 3, 25]
    for k in range(1, 8):
        narrow = token_logprobs(logits, torch.tensor([7]), k)
        assert narrow.top_ids[0].tolist() == wide.top_ids[0, :k].tolist(), k
        assert torch.equal(narrow.top_vals[0], wide.top_vals[0, :k])
    batch = torch.cat([torch.randn(1, 40), logits, torch.randn(2, 40)])
    beside = token_logprobs(batch, torch.tensor([0, 7, 0, 0]), 2)
    assert beside.top_ids[1].tolist() == [7, 19]
    assert bool((wide.top_vals[0, :-1] >= wide.top_vals[0, 1:]).all())


def test_many_rows_of_logprobs_are_taken_in_parts_with_each_rows_own_numbers(monkeypatch: pytest.MonkeyPatch):
    """A prefill chunk's prompt logprobs (up to 2,048 rows x the vocabulary) are taken a few rows at a time, so
    that their temporaries stay small (sampler._CPU_ELEMENTS: whole, they were page-faulted GBs that held every
    other request of the step). A row's logprob, alternatives and their order are the same in any part, as a
    row's are beside any neighbours; parts that do not divide the rows lose none and repeat none."""
    from engine.sampler import _token_logprobs, token_logprobs

    gen = torch.Generator().manual_seed(3)
    logits = torch.randn(37, 1000, generator=gen).to(torch.bfloat16)  # bfloat16: ties, as real logits have
    targets = torch.randint(0, 1000, (37,), generator=gen)
    whole = _token_logprobs(logits, targets, 5)
    monkeypatch.setattr(sampler_module, "_CPU_ELEMENTS", 8 * 1000)  # parts of 8 rows: 8, 8, 8, 8 and 5
    parts = token_logprobs(logits, targets, 5)
    for got, want in (
        (parts.chosen, whole.chosen),
        (parts.top_ids, whole.top_ids),
        (parts.top_vals, whole.top_vals),
    ):
        assert got.shape == want.shape and torch.equal(got, want)
    for i in (0, 8, 36):  # one row alone
        alone = _token_logprobs(logits[i : i + 1], targets[i : i + 1], 5)
        assert torch.equal(alone.top_ids[0], parts.top_ids[i]) and torch.equal(
            alone.chosen[0], parts.chosen[i]
        )
    assert token_logprobs(logits, targets, 0).top_ids.shape == (37, 0)
