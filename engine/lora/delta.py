"""The low-rank product of one adapter target, `x A^T (s B)^T` in float32, with every row's bits fixed.

Batch invariance (DESIGN.md) asks that a row's delta not depend on how many rows share the product. On CPU
both products run on oneDNN's packed float32 kernel (`engine.model.layers.linear`'s, on weights reordered once), padded to the
row multiple that `layers.linear.probe_row_multiple` measures for the shape on this machine, strictly: the same
kernel and probe the base model's dense linears rely on. Elsewhere (CUDA, or a CPU build without packed kernels) they are
plain float32 matmuls on the device.

Activations enter in the model's dtype and the delta is kept in float32: the caller adds it to the base
linear's output in float32 and rounds once to the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.kernels.invariance import PROBE_ROWS, pad_rows
from engine.model.layers.linear import packing_supported, probe_row_multiple


class TargetDelta(nn.Module):
    """One (layer, fused linear) of one adapter: forward(x [M, in], any float dtype) -> [M, out] float32."""

    def __init__(
        self, a: torch.Tensor, b_scaled: torch.Tensor, device: torch.device, batch_invariant: bool
    ) -> None:
        super().__init__()
        self.packed = packing_supported(device, torch.float32)
        if self.packed:
            # Both products on packed weights, the rows padded once to the larger of their multiples (both
            # powers of two): the zero pad rows stay zero through both and are cut once at the end.
            self.multiple = max(_multiple(a, batch_invariant), _multiple(b_scaled, batch_invariant))
            self.down = torch.ops.mkldnn._reorder_linear_weight(a.contiguous(), 1)  # [r, in]
            self.up = torch.ops.mkldnn._reorder_linear_weight(b_scaled.contiguous(), 1)  # [out, r]
        else:
            self.a, self.b = a.to(device), b_scaled.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if not self.packed:
            return F.linear(F.linear(x, self.a), self.b)
        m = x.shape[0]
        u = _linear(pad_rows(x.contiguous(), self.multiple), self.down, None)
        d = _linear(u, self.up, None)
        return d if d.shape[0] == m else d[:m]


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: None) -> torch.Tensor:
    """layers.linear's packed product (the kernel its probe measures), on a weight reordered by this module."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _multiple(weight: torch.Tensor, batch_invariant: bool) -> int:
    out_f, in_f = weight.shape
    return probe_row_multiple(in_f, out_f, torch.float32, PROBE_ROWS[-1]) if batch_invariant else 1
