"""The low-rank product of one adapter target, `x A^T (s B)^T` in float32, with every row's bits fixed.

Batch invariance (DESIGN.md) asks that a row's delta not depend on how many rows share the product. On CPU
both products run on oneDNN's packed float32 kernel (`cpu_linear.PackedLinear`), padded to the row multiple
that `cpu_linear.probe_row_multiple` measures for the shape on this machine, strictly: the same kernel and
probe the base model's dense linears rely on. Elsewhere (CUDA, or a CPU build without packed kernels) they are
plain float32 matmuls on the device.

Activations enter in the model's dtype and the delta is kept in float32: the caller adds it to the base
linear's output in float32 and rounds once to the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.cpu_linear import PackedLinear, packing_supported, probe_row_multiple
from engine.model.invariance import PROBE_ROWS


class _Dense(nn.Module):
    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


def product(weight: torch.Tensor, device: torch.device, batch_invariant: bool) -> nn.Module:
    """A module computing x W^T for float32 x ([M, in] -> [M, out]); `weight` [out, in] float32."""
    if packing_supported(device, torch.float32):
        out_f, in_f = weight.shape
        multiple = probe_row_multiple(in_f, out_f, torch.float32, PROBE_ROWS[-1]) if batch_invariant else 1
        return PackedLinear(weight, None, multiple)
    return _Dense(weight.to(device))


class TargetDelta(nn.Module):
    """One (layer, target) of one adapter: forward(x [M, in], any float dtype) -> [M, out] float32."""

    def __init__(
        self, a: torch.Tensor, b_scaled: torch.Tensor, device: torch.device, batch_invariant: bool
    ) -> None:
        super().__init__()
        self.down = product(a, device, batch_invariant)  # [M, in] -> [M, r]
        self.up = product(b_scaled, device, batch_invariant)  # [M, r] -> [M, out]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.up(self.down(x.float()))
