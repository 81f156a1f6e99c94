"""Speculative decoding, the scheduler's side: how many drafts each decoding request gets in a step, and what
its verified drafts do to the request.

Drafts come from the request's own tokens only (engine.ngram_proposer); the runner verifies them
(engine.spec_verify). Output never changes: every emitted token is the one plain decoding would sample there.

When to draft:
- only a request in decode (one known token left to compute), never one under a grammar: structured outputs
  turn speculation off for that request (its mask is per position and would need each draft accepted by the
  matcher first);
- K adapts per request: it grows by one after a step that accepted every draft and falls to one past what
  was accepted otherwise; a request whose single draft fails skips the next 1, 2, 4 .. 32 steps' lookups, so
  text with no repetition pays almost nothing;
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

from dataclasses import dataclass

from engine.ngram_proposer import NgramIndex
from engine.outputs import VerifiedDrafts
from engine.request import Request
from engine.spec_config import SpeculativeConfig
from metrics.stats import SpecDecodingStats

MAX_SKIP = 32  # steps a request with failing drafts waits at most before it looks up again


@dataclass(slots=True, eq=False)
class _RequestSpec:
    request: Request  # whose state this is (an id may be reused once its request has finished)
    index: NgramIndex
    k: int
    misses: int = 0  # consecutive single-draft failures
    skip: int = 0  # lookups left to skip


class SpecDecoder:
    def __init__(self, config: SpeculativeConfig, max_model_len: int) -> None:
        self.config = config
        self.max_model_len = max_model_len
        self._states: dict[str, _RequestSpec] = {}
        self._step_left = 0  # draft tokens this step may still hand out
        self._stats: SpecDecodingStats | None = None

    def begin_step(self, running: list[Request], num_waiting: int, live: dict[str, Request]) -> None:
        """Called once per scheduling pass, before any `propose`. No drafts while prompts wait or are being
        prefilled: drafts would take the step's token budget from them (measured: 16 free-text streams took
        more steps with drafts than without, 0.61x), and a step holding a prefill chunk is compute-bound."""
        c = self.config
        prefilling = num_waiting or any(r.num_tokens - r.num_computed_tokens > 1 for r in running)
        busy = len(running) > c.disable_by_batch_size or (prefilling and not c.draft_beside_prefill)
        self._step_left = 0 if busy else c.max_draft_tokens_per_step
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
            state = _RequestSpec(req, NgramIndex(c.prompt_lookup_min), c.num_speculative_tokens)
            self._states[req.request_id] = state
        if state.skip:
            state.skip -= 1
            return []
        drafts = state.index.propose(req.all_token_ids, min(state.k, left), self.config.prompt_lookup_max)
        self._step_left -= len(drafts)
        return drafts

    def apply(self, req: Request, num_drafts: int, verified: VerifiedDrafts) -> None:
        """After the runner verified `num_drafts` drafts of `req` (and `req.num_computed_tokens` was advanced
        over the whole chunk): rolls back what the rejected drafts computed, before the caller appends the
        emitted tokens; adapts K; counts the draft."""
        # The KV of the last known token and of the accepted drafts is kept, the rest discarded. (The caller
        # caps it below the tokens it appends: the last of them is computed next step.)
        req.num_computed_tokens -= num_drafts - verified.num_accepted
        state = self._states.get(req.request_id)
        if state is not None and state.request is req:
            self._adapt(state, num_drafts, verified.num_accepted)
        if self._stats is None:
            self._stats = SpecDecodingStats()
        self._stats.observe(num_drafts, verified.num_accepted)

    def _adapt(self, state: _RequestSpec, drafted: int, accepted: int) -> None:
        if accepted == drafted:
            state.k = min(self.config.num_speculative_tokens, state.k + 1)
            state.misses = 0
        elif accepted:
            state.k = accepted + 1
            state.misses = 0
        elif drafted > 1:
            state.k = 1
        else:
            state.misses += 1
            state.skip = min(MAX_SKIP, 1 << (state.misses - 1))

    def take_stats(self) -> SpecDecodingStats | None:
        """This step's drafts (None when none was verified); the next step starts afresh."""
        stats, self._stats = self._stats, None
        return stats
