"""The grammar masks of a step: filled on their own thread while the model's forward runs, applied to the
logits by the sampler.

Why: a structured-output row's mask (xgrammar's `fill_next_token_bitmask`, which releases the GIL) used to be
filled on the step thread after the forward, so every request in the batch waited for it: beside one stream
whose grammar is ambiguous, each step paid its mask on top of the forward. Here the runner starts the fill
before the forward (`MaskFiller.filling`) and the sampler waits for it only when it needs the masks, as vLLM
fills bitmasks while the forward runs. What a mask may cost is bounded apart (engine.grammar_state: a
grammar over the per-token budget is refused, or its request fails).

Imports engine.grammar_state (the matchers it fills) and engine.outputs (the step's rows), both for types
only; neither imports this module.

Rule kept: the fill ends before the step does (`filling` waits for it on exit, whatever happened), so a
sequence's `GrammarState` is never filled and advanced at once.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from engine.grammar_state import GrammarState
    from engine.outputs import ScheduledRequest


@dataclass(slots=True)
class StepMasks:
    """The masks of one step's constrained rows (`rows`: indices into the step's sampling requests)."""

    rows: list[int]
    bitmask: torch.Tensor  # [len(rows), ceil(vocab / 32)] int32, filled by the mask thread
    done: Future[None]

    def wait(self) -> torch.Tensor:
        self.done.result()
        return self.bitmask


def constrained_rows(reqs: Sequence[ScheduledRequest]) -> list[tuple[int, GrammarState]]:
    """(row, state) of every request whose grammar still constrains its next token."""
    return [(i, r.grammar) for i, r in enumerate(reqs) if r.grammar is not None and r.grammar.active]


def _fill(states: list[tuple[int, GrammarState]], bitmask: torch.Tensor) -> None:
    """Fills each state's row. A fill that raises is its own request's fault (a broken matcher): that row
    allows nothing, so it has no finite logit and the sampler fails that request alone (INVALID_TOKEN),
    where the exception would have failed the step and killed the engine for everyone."""
    for j, (_, state) in enumerate(states):
        try:
            state.fill_mask(bitmask, j)
        except Exception:
            logger.exception("a grammar mask could not be filled; its request fails")
            bitmask[j] = 0


class MaskFiller:
    """One thread that fills each step's grammar masks (one thread: a step's rows are few, and the forward
    beside it wants the other cores)."""

    def __init__(self, vocab_size: int) -> None:
        self.vocab_size = vocab_size
        self._pool: ThreadPoolExecutor | None = None  # started on the first constrained step

    @contextmanager
    def filling(self, reqs: Sequence[ScheduledRequest]) -> Iterator[StepMasks | None]:
        """Starts filling the masks of `reqs`' constrained rows; yields them (None when no row is
        constrained) and waits for the fill on exit."""
        states = constrained_rows(reqs)
        if not states:
            yield None
            return
        import xgrammar as xgr

        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="brine-grammar-mask")
        bitmask = xgr.allocate_token_bitmask(len(states), self.vocab_size)
        masks = StepMasks([r for r, _ in states], bitmask, self._pool.submit(_fill, states, bitmask))
        try:
            yield masks
        finally:
            with suppress(BaseException):  # its error, if any, was raised to the sampler already
                masks.done.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=True)


def apply_masks(
    logits: torch.Tensor,
    states: list[tuple[int, GrammarState]],
    vocab_size: int,
    filled: StepMasks | None = None,
) -> torch.Tensor:
    """Returns logits with each (row, state)'s disallowed tokens at -inf; other rows keep their exact values
    (rows are gathered, masked and scattered back: no operation spans rows). One host->device copy.
    `filled`: the same rows' masks, filled beside the forward (`MaskFiller`); otherwise filled here."""
    bitmask = filled.wait() if filled is not None else None  # never fill a state twice at once
    if bitmask is None or filled is None or filled.rows != [r for r, _ in states]:
        import xgrammar as xgr

        bitmask = xgr.allocate_token_bitmask(len(states), vocab_size)
        _fill(states, bitmask)
    rows = torch.tensor([r for r, _ in states], dtype=torch.int64)
    packed = torch.cat([rows, bitmask.view(-1).to(torch.int64)]).to(logits.device, non_blocking=True)
    idx, words = packed[: len(states)], packed[len(states) :].to(torch.int32).view(len(states), -1)
    # Bit b of word w allows token 32 * w + b.
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().view(len(states), -1)
    n = logits.shape[1]
    if allowed.shape[1] < n:  # logits wider than the tokenizer's vocabulary: padding ids are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, n - allowed.shape[1]), value=False)
    sub = logits.index_select(0, idx).masked_fill(~allowed[:, :n], float("-inf"))
    return logits.index_copy(0, idx, sub)
