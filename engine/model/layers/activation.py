"""SiLU, and the gated SiLU of the fused gate/up projection's output."""

from __future__ import annotations

import torch

from engine.model.kernels import fused_ops


def silu(x: torch.Tensor) -> torch.Tensor:
    """F.silu's math (float32, one rounding to x's dtype) from ops that round alike at every position.

    F.silu's CPU kernel computes the last elements of each thread's share with scalar code, whose exp rounds
    differently from the vectorised one, and where the shares split depends on the number of tokens: so a
    token's activation could depend on the batch. torch.exp and IEEE division are the same everywhere."""
    xf = x.float()
    return (xf / (1 + torch.exp(-xf))).to(x.dtype)


def silu_and_mul(gate_up: torch.Tensor, fused: bool) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 I] (gate first); `fused`: the native kernel may run it (declared by
    the architecture), else the torch ops above."""
    if fused:
        return fused_ops.silu_mul(gate_up, silu)
    gate, up = gate_up.chunk(2, dim=-1)
    return silu(gate) * up
