"""`LoRALinear`: a base linear of the decoder plus every row's adapter delta, gathered per adapter.

A step's rows belong to requests with different adapters, or none. The runner gives the step's row groups
(`LoRAStep.groups`: each adapter with the rows that use it) before the forward; each wrapper then runs its
base linear over all rows, as without adapters, and for each group gathers the group's rows, computes their
low-rank products (punica's gathered BGMV, as a loop over the step's adapters) and adds them to those rows'
columns of the output. q/k/v and gate/up are fused in the model, so a wrapper maps each PEFT target to its
column slice of the fused output.

Why a row's bits do not depend on its neighbours: base rows get no delta at all (the base output is the same
tensor as without adapters); an adapter row's delta is computed by row-count invariant products
(`engine.lora.delta`) from its own activations, and added elementwise. The base linear may be any of the
model's (quantized, packed, dense): the delta is added to its output.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import nn

from engine.lora.adapter import LoRAAdapter
from engine.model.models.llama import DecoderLayer, LlamaForCausalLM


@dataclass(slots=True)
class LoRAStep:
    """The current step's row groups, set by the runner around the forward (empty: no adapter rows)."""

    groups: list[tuple[LoRAAdapter, torch.Tensor]] = field(default_factory=list)  # (adapter, rows [n])


# Each fused linear of the model and the PEFT targets whose outputs it holds side by side, in column order.
FUSED: dict[str, tuple[str, ...]] = {
    "qkv_proj": ("q_proj", "k_proj", "v_proj"),
    "o_proj": ("o_proj",),
    "gate_up_proj": ("gate_proj", "up_proj"),
    "down_proj": ("down_proj",),
}


def fused_columns(out_features: dict[str, int]) -> dict[str, dict[str, tuple[int, int]]]:
    """{fused linear: {target: (first column, end column)}} from each target's output width."""
    out: dict[str, dict[str, tuple[int, int]]] = {}
    for fused, targets in FUSED.items():
        c0, cols = 0, {}
        for t in targets:
            cols[t] = (c0, c0 + out_features[t])
            c0 += out_features[t]
        out[fused] = cols
    return out


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


def wrap_model(model: LlamaForCausalLM, step: LoRAStep) -> int:
    """Wraps every decoder layer's q/k/v, o, gate/up and down linears in place; returns how many."""
    n = 0
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        for parent, name in (
            (layer.self_attn, "qkv_proj"),
            (layer.self_attn, "o_proj"),
            (layer.mlp, "gate_up_proj"),
            (layer.mlp, "down_proj"),
        ):  # setattr: the attributes are typed as the base linears
            setattr(parent, name, LoRALinear(getattr(parent, name), i, name, step))
            n += 1
    return n
