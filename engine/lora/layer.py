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
from typing import TYPE_CHECKING

import torch
from torch import nn

from engine.model.llama import DecoderLayer, LlamaForCausalLM

if TYPE_CHECKING:
    from engine.lora.manager import LoRAAdapter


@dataclass(slots=True)
class LoRAStep:
    """The current step's row groups, set by the runner around the forward (empty: no adapter rows)."""

    groups: list[tuple[LoRAAdapter, torch.Tensor]] = field(default_factory=list)  # (adapter, rows [n])


class LoRALinear(nn.Module):
    """forward(x [T, in]) -> [T, out]: `base(x)`, plus each adapter row's delta in its targets' columns."""

    def __init__(
        self, base: nn.Module, layer: int, slices: tuple[tuple[str, int, int], ...], step: LoRAStep
    ) -> None:
        super().__init__()
        self.base = base
        self.layer = layer
        self.slices = slices  # (PEFT target, first column, end column) of this fused linear's output
        self.step = step

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base(x)
        for adapter, rows in self.step.groups:
            xs: torch.Tensor | None = None
            for target, c0, c1 in self.slices:
                delta = adapter.deltas.get((self.layer, target))
                if delta is None:
                    continue
                if xs is None:
                    xs = x.index_select(0, rows)
                d = delta(xs)  # [n, c1 - c0] float32
                # One rounding to the model's dtype, after adding in float32.
                y[rows, c0:c1] = (y[rows, c0:c1].float() + d).to(y.dtype)
        return y

    def extra_repr(self) -> str:
        return f"layer={self.layer}, targets={[t for t, _, _ in self.slices]}"


def wrap_model(model: LlamaForCausalLM, step: LoRAStep) -> int:
    """Wraps every decoder layer's q/k/v, o, gate/up and down linears in place; returns how many."""
    cfg = model.cfg
    q, kv, inter = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim, cfg.intermediate_size
    n = 0
    for i, layer in enumerate(model.layers):
        assert isinstance(layer, DecoderLayer)
        attn, mlp = layer.self_attn, layer.mlp
        fused = (
            (attn, "qkv_proj", (("q_proj", 0, q), ("k_proj", q, q + kv), ("v_proj", q + kv, q + 2 * kv))),
            (attn, "o_proj", (("o_proj", 0, cfg.hidden_size),)),
            (mlp, "gate_up_proj", (("gate_proj", 0, inter), ("up_proj", inter, 2 * inter))),
            (mlp, "down_proj", (("down_proj", 0, cfg.hidden_size),)),
        )
        for parent, name, slices in fused:  # setattr: the attributes are typed as the base linears
            setattr(parent, name, LoRALinear(getattr(parent, name), i, slices, step))
        n += 4
    return n
