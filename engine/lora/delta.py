"""The low-rank product of one adapter target, `x A^T (s B)^T` in float32, with every row's bits fixed.

Batch invariance (DESIGN.md) asks that a row's delta not depend on how many rows share the product. On CPU
both products run on oneDNN's packed float32 kernel (`engine.model.layers.linear`'s, on weights reordered once), padded to the
row rule that `layers.linear.probe_row_rule` measures for the shape on this machine, strictly: the same
kernel and probe the base model's dense linears rely on. Elsewhere (CUDA, or a CPU build without packed kernels) they are
plain float32 matmuls on the device.

Activations enter in the model's dtype and the delta is kept in float32: the caller adds it to the base
linear's output in float32 and rounds once to the model's dtype.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from engine.model.kernels.invariance import PROBE_ROWS, RowRule
from engine.model.layers.linear import packing_supported, probe_row_rule


class TargetDelta(nn.Module):
    """One (layer, fused linear) of one adapter: forward(x [M, in], any float dtype) -> [M, out] float32."""

    def __init__(
        self, a: torch.Tensor, b_scaled: torch.Tensor, device: torch.device, batch_invariant: bool
    ) -> None:
        super().__init__()
        self.packed = packing_supported(device, torch.float32)
        if self.packed:
            # Both products on packed weights, under a rule both accept (the larger multiple, the smaller cap):
            # the zero pad rows stay zero through both and are cut once at the end.
            self.rows = _rule(a, batch_invariant).and_(_rule(b_scaled, batch_invariant))
            self.down = torch.ops.mkldnn._reorder_linear_weight(a.contiguous(), 1)  # [r, in]
            self.up = torch.ops.mkldnn._reorder_linear_weight(b_scaled.contiguous(), 1)  # [out, r]
        else:
            self.a, self.b = a.to(device), b_scaled.to(device)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x.float()
        if not self.packed:
            return F.linear(F.linear(x, self.a), self.b)
        return self.rows.apply(self._products, x.contiguous())

    def _products(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(_linear(x, self.down, None), self.up, None)


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: None) -> torch.Tensor:
    """layers.linear's packed product (the kernel its probe measures), on a weight reordered by this module."""
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _rule(weight: torch.Tensor, batch_invariant: bool) -> RowRule:
    out_f, in_f = weight.shape
    return probe_row_rule(in_f, out_f, torch.float32, PROBE_ROWS[-1]) if batch_invariant else RowRule()
