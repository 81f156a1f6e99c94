"""One sequence's place in its grammar (`GrammarState`) and what its request's masks may cost (`MaskBudget`):
the per-request half of structured outputs, which the scheduler hands to the runner and the mask thread
fills (engine.grammar_masks).

The mask budget (CPU time per token) is a request's own: what the masks of all its n sequences cost for one
token, never shared with or spent by another request, so only a request's own grammar decides whether it is
refused or failed. A request whose sequences' first masks together are over it is refused up front
(`check_sequences`, the client's 400); one whose masks go over it later (grammars whose cost grows with the
output: ambiguous EBNF) for MASK_STRIKES tokens in a row fails on its next token (`GrammarTooSlowError`, whose
message names the budget), while the batch goes on.

Rules a caller keeps: a `GrammarState` belongs to one sequence; `accept()` is called once per generated token,
in order (the request calls it as its tokens grow), and `fill_mask()` only between two accepts (the mask
thread fills it while the forward runs, and the runner waits for it before the step ends). A preemption
recomputes KV, never tokens, so the state stays valid across it. The n states of one request share one
`MaskBudget` (`grammar_states`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.grammar_compile import over_budget
from engine.structured_spec import GrammarTooSlowError, StructuredOutputSpec

if TYPE_CHECKING:
    import torch

# Consecutive tokens over the budget before a request fails: one slow fill may be a page fault.
MASK_STRIKES = 2


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    spec: StructuredOutputSpec
    compiled: Any  # xgrammar.CompiledGrammar
    mask_budget_s: float = float("inf")
    memory_bytes: int = 0
    first_mask_s: float = 0.0  # CPU time of its first token's mask, when it was compiled


class MaskBudget:
    """One request's per-token mask budget, shared by the `GrammarState`s of its n sequences: what their masks
    cost for the same token position is summed, so n sequences of one grammar spend one budget, and nothing of
    another request's."""

    __slots__ = ("_spent", "budget_s", "sequences")

    def __init__(self, budget_s: float, sequences: int = 1) -> None:
        self.budget_s = budget_s
        self.sequences = sequences
        self._spent: dict[int, float] = {}  # token position -> CPU seconds of its sequences' masks there

    def charge(self, position: int, seconds: float) -> float:
        """Adds one sequence's mask at `position`; returns the request's cost at that position so far."""
        total = self._spent.get(position, 0.0) + seconds
        self._spent[position] = total
        # Sequences step together; one preempted may lag by a token or two. Older positions are done.
        for old in [p for p in self._spent if p < position - 2]:
            del self._spent[old]
        return total

    def spent(self, position: int) -> float:
        """The request's mask cost at `position` so far (CPU seconds)."""
        return self._spent.get(position, 0.0)


class GrammarState:
    """One sequence's position in its grammar, and what its masks cost (CPU seconds, on the filling thread),
    charged to its request's `MaskBudget`."""

    __slots__ = ("_charged", "_matcher", "budget", "last_fill_s", "position", "rejected", "strikes")

    def __init__(self, grammar: CompiledGrammar, budget: MaskBudget | None = None) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(grammar.compiled)
        self.rejected = False  # a token the grammar refused was appended (only if the mask was bypassed)
        self.budget = budget if budget is not None else MaskBudget(grammar.mask_budget_s)
        self.position = 0  # tokens accepted
        self.last_fill_s = 0.0
        self._charged = (-1, 0.0)  # (position, seconds) this state last charged to the budget
        self.strikes = 0  # consecutive tokens whose request's masks went over the budget

    @property
    def budget_s(self) -> float:
        return self.budget.budget_s

    def accept(self, token_id: int) -> None:
        """Raises GrammarTooSlowError (after accepting) once MASK_STRIKES tokens in a row went over budget:
        the caller (the scheduler's update) fails this sequence, and with it its request."""
        if self.rejected or self._matcher.is_terminated():
            return
        if not self._matcher.accept_token(token_id):
            self.rejected = True
        self.position += 1
        if self.strikes >= MASK_STRIKES:
            spent = self.budget.spent(self.position - 1)
            raise GrammarTooSlowError(spent, self.budget_s, self.budget.sequences)

    @property
    def active(self) -> bool:
        """False once the grammar is finished (stop token accepted) or broken: no mask applies any more."""
        return not self.rejected and not self._matcher.is_terminated()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        # CPU time, not wall time: a fill that waited for a core (2 cores, a forward beside it) is not slow.
        start = time.thread_time()
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self.last_fill_s = time.thread_time() - start
        # Filled again at the same position (the sampler's fallback): the new cost replaces the old one.
        pos, before = self._charged
        extra = self.last_fill_s - (before if pos == self.position else 0.0)
        self._charged = (self.position, self.last_fill_s)
        spent = self.budget.charge(self.position, extra)
        self.strikes = self.strikes + 1 if spent > self.budget_s else 0


def grammar_states(grammar: CompiledGrammar | None, sequences: int) -> list[GrammarState | None]:
    """The matchers of one request's `sequences` sequences, sharing the request's one mask budget (all None
    for an unconstrained request)."""
    if grammar is None:
        return [None] * sequences
    budget = MaskBudget(grammar.mask_budget_s, sequences)
    return [GrammarState(grammar, budget) for _ in range(sequences)]


def check_sequences(grammar: CompiledGrammar, sequences: int) -> CompiledGrammar:
    """`grammar` for a request of `sequences` sequences; StructuredOutputError (a 400) if their first masks
    together are over the per-token budget: the request would fail on its first tokens."""
    if grammar.first_mask_s * sequences > grammar.mask_budget_s:
        raise over_budget(grammar.spec, grammar.first_mask_s, grammar.mask_budget_s, sequences)
    return grammar
