"""`LoRALinear`: a base linear of the decoder plus every row's adapter delta, gathered per adapter.

A step's rows belong to requests with different adapters, or none. The runner gives the step's row groups
(`LoRAStep.groups`: each adapter with the rows that use it) before the forward; each wrapper then runs its
base linear over all rows, as without adapters, and for each group gathers the group's rows, computes their
low-rank products (punica's gathered BGMV, as a loop over the step's adapters) and adds them to those rows'
columns of the output. q/k/v and gate/up are fused in the model, so an adapter's delta for a fused linear
covers its PEFT targets' column slices (`engine.lora.manager` builds them).

The model wraps its own linears (`LlamaForCausalLM.enable_lora`); the adapters and their deltas are
`engine.lora`'s, read here through the `Adapter` Protocol so that layers never import it.

Why a row's bits do not depend on its neighbours: base rows get no delta at all (the base output is the same
tensor as without adapters); an adapter row's delta is computed by row-count invariant products
(`engine.lora.delta`) from its own activations, and added elementwise. The base linear may be any of the
model's (quantized, packed, dense): the delta is added to its output.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch
from torch import nn


class Adapter(Protocol):
    """What a wrapper reads of a loaded adapter (`engine.lora.adapter.LoRAAdapter`)."""

    # (layer, fused linear: 'qkv_proj', ...) -> its delta: forward(x [n, in]) -> [n, out] float32
    deltas: dict[tuple[int, str], nn.Module]


@dataclass(slots=True)
class LoRAStep:
    """The current step's row groups, set by the LoRA manager around the forward (empty: no adapter rows)."""

    groups: list[tuple[Adapter, torch.Tensor]] = field(default_factory=list)  # (adapter, rows [n])


class LoRALinear(nn.Module):
    """forward(x [T, in]) -> [T, out]: `base(x)`, plus each adapter row's delta.

    An adapter's delta for this linear is one module (`adapter.deltas[(layer, name)]`) covering all the
    linear's targets at once: the targets' A stacked, their B block-diagonal (zero where a target is absent),
    so a fused q/k/v costs two products per adapter, not six; the zero blocks add exact zeros."""

    def __init__(self, base: nn.Module, layer: int, name: str, step: LoRAStep) -> None:
        super().__init__()
        self.base = base
        self.key = (layer, name)
        self.step = step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for adapter, rows in self.step.groups:
            delta = adapter.deltas.get(self.key)
            if delta is None:
                continue
            d = delta(x.index_select(0, rows))  # [n, out] float32
            # Rows are distinct: each element gets one add, y + d, rounded once to the model's dtype.
            if y.dtype == torch.float32:
                y.index_add_(0, rows, d)
            else:
                y.index_copy_(0, rows, (y.index_select(0, rows).float() + d).to(y.dtype))
        return y

    def extra_repr(self) -> str:
        return f"layer={self.key[0]}, {self.key[1]}"
