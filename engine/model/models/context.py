"""`ForwardContext`: one step's state as every layer reads it, built once per step by the runner.

It replaces the per-step values that were threaded through every layer as positional arguments (the attention
backend, its plan, the slots, the caches). The rotary table stays the model's: the model looks up the step's
cos/sin from `positions` and hands them to its layers beside the context.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from engine.model.attention.base import AttentionBackend, AttentionMetadata


class LayerStack(Protocol):
    """Every decoder layer of a step in one call (models.native_stack); the runner builds one where declared."""

    def run(
        self, h: torch.Tensor, rope: tuple[torch.Tensor, torch.Tensor], ctx: ForwardContext
    ) -> torch.Tensor | None:
        """The final norm of the rows `ctx.logits_indices` names [N, hidden], or None where this step is not
        one it runs."""
        ...


@dataclass(slots=True)
class ForwardContext:
    positions: torch.Tensor  # [T]
    backend: AttentionBackend
    plan: object  # backend.plan(meta): shared by every layer of the step
    slot_mapping: torch.Tensor  # [T]: each new token's cache slot
    k_caches: Sequence[torch.Tensor]  # per layer [num_blocks, block_size, Hkv, D]
    v_caches: Sequence[torch.Tensor]
    logits_indices: torch.Tensor  # [N]: rows whose next-token logits are wanted
    layer_stack: LayerStack | None = None  # runs the layers instead of the Python loop, where it can
    # Called between two decoder layers (never before the first or after the last), on the step's thread: the
    # engine runs a short step of other requests there (engine.express). It must not touch this step's
    # requests, blocks or buffers; the layers' results do not depend on it.
    between_layers: Callable[[], None] | None = None
    # logits_indices on the host, where the caller has it: the native stack then runs its last layer past the
    # keys and values only for these rows (None: it runs every row, as the Python layers do).
    logits_rows: Sequence[int] | None = None

    @classmethod
    def for_step(
        cls,
        backend: AttentionBackend,
        meta: AttentionMetadata,
        positions: torch.Tensor,
        k_caches: Sequence[torch.Tensor],
        v_caches: Sequence[torch.Tensor],
        logits_indices: torch.Tensor,
        layer_stack: LayerStack | None = None,
        between_layers: Callable[[], None] | None = None,
        logits_rows: Sequence[int] | None = None,
    ) -> ForwardContext:
        """The context of one step: plans the attention once for all layers."""
        plan = backend.plan(meta)
        return cls(
            positions,
            backend,
            plan,
            meta.slot_mapping,
            k_caches,
            v_caches,
            logits_indices,
            layer_stack,
            between_layers,
            logits_rows,
        )
