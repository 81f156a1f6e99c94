"""Speculative decoding, the scheduler's side: how many drafts each decoding request gets in a step, and what
its verified drafts do to the request.

Drafts come from the request's own tokens only (engine.ngram_proposer); the runner verifies them
(engine.spec_verify). Output never changes: every emitted token is the one plain decoding would sample there.

When to draft:
- only a request in decode (one known token left to compute), never one under a grammar: structured outputs
  turn speculation off for that request (its mask is per position and would need each draft accepted by the
  matcher first);
- K adapts per request, from what its drafts have done: the request keeps a running estimate of the chance
  that a draft token is accepted once the drafts before it were (its accepted drafts over the drafts it has
  tested, the recent ones weighing most), and drafts the number of tokens that makes the most tokens per
  unit of step cost (num_drafts): the j-th token is accepted at all with that chance to the power j, and its
  row costs the step's threshold of a sequence's row, so the first is drafted while its chance is at least
  the threshold (below it, a draft row costs more than it is expected to save) and a later one only while it
  is likelier still. The threshold is `min_draft_acceptance` where given, else what a
  draft row measured to cost over a sequence's own row in this engine's recent steps of the same batch size
  (engine.spec_cost: on CPU from ~0.07 at one sequence on an AMX Xeon to ~0.3 at 16 on an EPYC;
  docs/speculative-decoding.md). A request whose drafts fail while even one
  token is below that skips the next 1, 2, 4 .. 32 steps' lookups, so text with no repetition pays almost
  nothing;
- per step, none while a prompt waits or is being prefilled, none while more than `disable_by_batch_size`
  sequences run, and at most
  `max_draft_tokens_per_step` drafts in the step together (a large batch is compute-bound, where a rejected
  draft costs as much as a real token);
- never past max_tokens, the context length or the step's token budget.

State rules: a request's rejected drafts were computed into its own unfilled KV slots only (a draft sits
after the last known token, in a block that is not full and so never cached or shared); `apply` rolls
`num_computed_tokens` back to the accepted tokens, so those slots are overwritten by the next step, and the
KV cache manager hashes and caches only blocks full of known (appended) tokens.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from engine.ngram_proposer import NgramIndex
from engine.outputs import VerifiedDrafts
from engine.request import Request
from engine.spec_config import SpeculativeConfig
from engine.spec_cost import FALLBACK, DraftCost
from metrics.stats import SpecDecodingStats

MAX_SKIP = 32  # steps a request with failing drafts waits at most before it looks up again
# The estimate's start (3 accepted of 4 tested: a fresh request drafts a few tokens, as copying text does)
# and how fast old drafts fade (each verification keeps this much of the counts so far: ~6 drafts' memory).
PRIOR_ACCEPTED, PRIOR_TESTED = 3.0, 4.0
DECAY = 0.85


@dataclass(slots=True, eq=False)
class RequestSpec:
    request: Request  # whose state this is (an id may be reused once its request has finished)
    index: NgramIndex
    accepted: float = PRIOR_ACCEPTED  # draft tokens accepted (decayed)
    tested: float = PRIOR_TESTED  # draft tokens whose fate was seen: the accepted ones, and a rejected one
    misses: int = 0  # consecutive verifications that accepted nothing while drafting was not worth it
    skip: int = 0  # lookups left to skip

    def rate(self) -> float:
        """The chance that a draft token is accepted, given that the drafts before it were."""
        return self.accepted / self.tested


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self._states: dict[str, RequestSpec] = {}
        self._step_left = 0  # draft tokens this step may still hand out
        self._stats: SpecDecodingStats | None = None
        # min_draft_acceptance "auto" (None): measured from the engine's own steps (engine.spec_cost), per step's
        # batch size; a number: that, always.
        self.cost = DraftCost() if config.min_draft_acceptance is None else None
        self.threshold = FALLBACK if config.min_draft_acceptance is None else config.min_draft_acceptance

    def begin_step(self, running: list[Request], num_waiting: int, live: dict[str, Request]) -> None:
        """Called once per scheduling pass, before any `propose`. No drafts while prompts wait or are being
        prefilled: drafts would take the step's token budget from them (measured: 16 free-text streams took
        more steps with drafts than without, 0.61x), and a step holding a prefill chunk is compute-bound."""
        c = self.config
        prefilling = num_waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in running)
        busy = len(running) > c.disable_by_batch_size or (prefilling and not c.draft_beside_prefill)
        self._step_left = 0 if busy else c.max_draft_tokens_per_step
        if self.cost is not None:
            self.threshold = self.cost.threshold(len(running))
        if len(self._states) > len(live):  # some finished: drop their indexes
            self._states = {rid: s for rid, s in self._states.items() if live.get(rid) is s.request}

    def propose(self, req: Request, budget: int) -> list[int]:
        """Drafts for `req`, which is about to compute its last known token, within `budget` tokens."""
        params = req.sampling_params
        left = min(budget, self._step_left, self.max_model_len - req.num_tokens)
        if params.max_tokens is not None:
            left = min(left, params.max_tokens - req.num_output_tokens - 1)
        if left < 1 or req.grammar is not None:
            return []
        state = self._states.get(req.request_id)
        if state is None or state.request is not req:
            c = self.config
            state = RequestSpec(req, NgramIndex(c.prompt_lookup_min))
            self._states[req.request_id] = state
        drafts = self.draft(
            state, left, lambda k: state.index.propose(req.all_token_ids, k, self.config.prompt_lookup_max)
        )
        self._step_left -= len(drafts)
        return drafts

    def draft(self, state: RequestSpec, left: int, lookup: Callable[[int], list[int]]) -> list[int]:
        """A request's drafts in a step that allows it `left` (>= 1): none while it skips lookups, else what
        `lookup` finds for the K its acceptance rate is worth (num_drafts), at most `left`. benchmarks/spec_replay
        runs the same steps offline, with other lookups."""
        if state.skip:
            state.skip -= 1
            return []
        return lookup(min(self.num_drafts(state.rate()), left))

    def apply(self, req: Request, num_drafts: int, verified: VerifiedDrafts) -> None:
        """After the runner verified `num_drafts` drafts of `req` (and `req.num_computed_tokens` was advanced
        over the whole chunk): rolls back what the rejected drafts computed, before the caller appends the
        emitted tokens; adapts K; counts the draft."""
        # The KV of the last known token and of the accepted drafts is kept, the rest discarded. (The caller
        # caps it below the tokens it appends: the last of them is computed next step.)
        req.num_computed_tokens -= num_drafts - verified.num_accepted
        state = self._states.get(req.request_id)
        if state is not None and state.request is req:
            self.adapt(state, num_drafts, verified.num_accepted)
        if self._stats is None:
            self._stats = SpecDecodingStats(threshold=self.threshold)
        self._stats.observe(num_drafts, verified.num_accepted)

    def observe_step(self, num_seqs: int, num_drafts: int, seconds: float) -> None:
        """A decode-only step's wall time (engine.engine_core), for the measured threshold."""
        if self.cost is not None:
            self.cost.observe(num_seqs, num_drafts, seconds)

    def num_drafts(self, rate: float) -> int:
        """How many tokens to draft at this per-token acceptance `rate`: the K that makes the most tokens per
        unit of step cost. A step with K drafts makes 1 + rate + .. + rate ** K tokens on average (the j-th is
        accepted with chance rate ** j) for a cost of 1 + K c, c being the step's threshold (what a draft row
        costs over a sequence's own row: min_draft_acceptance, or measured, engine.spec_cost). So the j-th is
        drafted while rate ** j / c is at least the tokens per cost of the drafts before it: the first while
        rate >= c, a later one only while it is likelier still. (Drafting every j with rate ** j >= c, as
        before, maximised tokens minus cost, not tokens per cost: benchmarks/spec_replay.py over 16 answers,
        steps priced at c = 0.29 as at 16 sequences on an AVX512-BF16 EPYC, 1.26x -> 1.32x median.) At least
        one (a probe, which `adapt` spaces out while it keeps failing), at most num_speculative_tokens."""
        c = self.config
        k, chance, tokens, cost = 0, rate, 1.0, 1.0
        while k < c.num_speculative_tokens and chance * cost >= self.threshold * tokens:
            k += 1
            tokens += chance
            cost += self.threshold
            chance *= rate
        return max(1, k)

    def adapt(self, state: RequestSpec, drafted: int, accepted: int) -> None:
        """After `drafted` drafts of which the first `accepted` were: the rate estimate, and the lookups to skip."""
        state.accepted = state.accepted * DECAY + accepted
        state.tested = state.tested * DECAY + accepted + (1 if accepted < drafted else 0)
        if accepted == 0 and state.rate() < self.threshold:
            state.misses += 1
            state.skip = min(MAX_SKIP, 1 << (state.misses - 1))
        else:
            state.misses = 0

    def take_stats(self) -> SpecDecodingStats | None:
        """This step's drafts (None when none was verified); the next step starts afresh."""
        stats, self._stats = self._stats, None
        return stats
