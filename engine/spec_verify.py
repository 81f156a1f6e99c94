"""Verifying drafts: which sampler rows a drafted request gets, and which of its drafts it keeps.

A request with K drafts is one chunk of K + 1 tokens (its last known token, then the drafts), run through the
same paged path as a chunk of a prefill; the model gives logits at all K + 1 positions. Brine's kernels are
batch- and chunk-invariant, so the logits at position j are the bits a plain decode step would have computed
there, had the tokens before it been the same.

`verify_rows` gives the sampler one row per position, each a copy of the request's `ScheduledRequest` whose
history is the sequence up to that position (the drafts before it included) and whose output count is the
output position: penalties, min_tokens, the seeded generator (keyed by (seed, output position),
engine.sampler.mix_seed) and logprobs see exactly what they would see without speculation. `accept` then keeps
the longest prefix of drafts equal to the token sampled at their position, plus the token sampled right after
it: greedy, that is the argmax; seeded, the draw non-speculative decoding makes; unseeded, a draw from the
same distribution (so the output distribution is unchanged too). Every emitted token is a sampled one.

A position with nothing to sample (INVALID_TOKEN) is an error only when it is reached: if the drafts before it
were accepted, they are emitted without it, and the next step samples that position again, fails the same way
and fails the request there, as plain decoding would after the same tokens.
"""

from __future__ import annotations

import dataclasses

from engine.outputs import ScheduledRequest, TokenLogprob, VerifiedDrafts
from engine.sampler import INVALID_TOKEN


def verify_rows(r: ScheduledRequest) -> list[ScheduledRequest]:
    """The sampler rows of a drafted request, one per verified position (len(drafts) + 1)."""
    drafts = r.draft_token_ids
    rows = [r]
    for j in range(1, len(drafts) + 1):
        rows.append(
            dataclasses.replace(
                r,
                all_token_ids=r.all_token_ids + drafts[:j],
                num_output_tokens=r.num_output_tokens + j,
                draft_token_ids=[],
            )
        )
    return rows


def sampling_rows(
    reqs: list[ScheduledRequest],
) -> tuple[list[ScheduledRequest], list[tuple[ScheduledRequest, int]]]:
    """The sampler's rows for a step (one per sampling request, len(drafts) + 1 per drafted one) and, per
    drafted request, (request, its first row)."""
    rows: list[ScheduledRequest] = []
    spans: list[tuple[ScheduledRequest, int]] = []
    for r in reqs:
        if not r.sample:
            continue
        if r.draft_token_ids:
            spans.append((r, len(rows)))
            rows += verify_rows(r)
        else:
            rows.append(r)
    return rows, spans


def accept(
    drafts: list[int], sampled: list[int], logprobs: list[TokenLogprob] | None
) -> VerifiedDrafts | str:
    """The tokens a drafted request emits, given the token sampled at each of its len(drafts) + 1 positions
    (and their logprob records, when asked); an error message when its first position had nothing to sample."""
    n = 0
    while n < len(drafts) and sampled[n] == drafts[n]:
        n += 1
    if sampled[n] == INVALID_TOKEN:
        if n == 0:
            return "no token could be sampled: no logit was finite after penalties, temperature and masks"
        return VerifiedDrafts(sampled[:n], logprobs[:n] if logprobs is not None else None, n)
    return VerifiedDrafts(sampled[: n + 1], logprobs[: n + 1] if logprobs is not None else None, n)
