"""RMSNorm, as transformers computes it: the mean of squares in float32, then cast back, then the weight.

`forward` is the reference (and what a model variant overrides, e.g. Gemma's (1 + w)). Where the model's
architecture declares the fused elementwise kernels (`models.registry`), `norm` and `add_norm` run one native
call each on CPU (`kernels.fused_ops`); otherwise they are `forward` itself, so an override is never skipped.
"""

from __future__ import annotations

import torch
from torch import nn

from engine.model.kernels import fused_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float, fused: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps
        self.fused = fused  # the native kernel may stand in for forward (declared by the architecture)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def norm(self, h: torch.Tensor) -> torch.Tensor:
        """norm(h) for h [T, hidden]: the kernel where declared and it applies, else forward."""
        return fused_ops.rms_norm(h, self) if self.fused else self(h)

    def add_norm(self, h: torch.Tensor, delta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h + delta, norm(h + delta)): the residual add fused with the norm where declared."""
        if self.fused:
            return fused_ops.add_rms_norm(h, delta, self)
        total = h + delta
        return total, self(total)
