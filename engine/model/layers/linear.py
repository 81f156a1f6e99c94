"""CPU linear layers on weights pre-packed once into oneDNN's blocked layout: fast, and batch-invariant.

Speed: a bfloat16 `F.linear` on CPU hands oneDNN a row-major weight, which it reorders on every call; decode
streams every weight once per step, so that work was paid per layer per token. Packing once at load time
(what inductor's weight freezing does) lets the kernel stream the weights as stored, which makes a whole
bfloat16 decode step clearly faster (benchmarks/decode_bench.py --baseline measures it).

Invariance: a row's result must not depend on how many rows share the product (see `invariance`). The packed
oneDNN kernels have that property once tiny products are padded to a few rows, in bfloat16 and float32 alike,
while float32 `F.linear` (MKL) does not have it at all: so both dtypes run packed, and each layer pads its
rows as `invariance.row_rule` measured for its shape on this machine (a row multiple; on an AMX Xeon, for
some shapes, a cap on the rows per call too). Packed results
differ from `F.linear`'s in the last bits (another accumulation order); both agree with transformers within
the model tests' tolerance.

bfloat16 on a CPU without native bfloat16 (no AVX512-BF16, no AMX: Skylake to Ice Lake Xeons, every AVX2
machine): oneDNN emulates bfloat16 there, and its kernels are not row-count invariant (an Ice Lake Xeon: one
row of a 576 -> 3,072 product, taken alone, differed from the same row among 700), while a probe cannot see it:
the products are rounded to bfloat16, which hides a different float32 sum in all but a few rows. So there the
layer keeps the bfloat16 weights' exact values in float32 and runs the float32 packed kernel, whose results
the probe compares in full float32 bits, then rounds the output to bfloat16: a bfloat16 model's linears are
then x W^T rounded once (as oneDNN's emulation computes it, in float32), at float32's cost.

A packed weight is an opaque `torch._mkldnn` tensor: the model cannot be moved or cast afterwards, which is
why packing is the last step of loading (the model's `linear_plan.LinearPlan` packs each linear once its
weights are in). A tied output head gets its own packed copy of the embedding matrix (the lookup needs the
plain one): 56 MB more for the default model in bfloat16.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from engine.model.kernels.invariance import RowRule, row_rule, sensitize

PACKED_DTYPES = (torch.bfloat16, torch.float32)
# The output head is probed on fewer rows (it is 49152 x 576 for the default model): it runs one row per
# sampling sequence, and its kernel family is the one probed in full on the other layers.
HEAD_PROBE_ROWS = 16


def compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a packed linear of `dtype` computes in here: float32 for bfloat16 where the CPU has no native
    bfloat16 (see the module docstring), else `dtype` itself."""
    from engine.model.device import cpu_has_native_bf16

    return torch.float32 if dtype == torch.bfloat16 and not cpu_has_native_bf16() else dtype


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """True where this torch build can run linears of `dtype` on packed oneDNN weights."""
    if device.type != "cpu" or dtype not in PACKED_DTYPES or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    try:
        if not (hasattr(ops, "_reorder_linear_weight") and hasattr(ops, "_linear_pointwise")):
            return False
        return compute_dtype(dtype) != torch.bfloat16 or bool(ops._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # pragma: no cover - builds without these ops
        return False


def _linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """y = x W^T + b with W held packed; a drop-in for an `nn.Linear` at inference, on a flat [M, in] input.

    `rows`: how inputs are fed to the kernel (padded with zero rows to a multiple, in calls of at most a cap),
    so that every row gets the bits it would get in any other batch (see `invariance`); the default calls it
    once on the rows as they are. A bfloat16 weight computes in `compute_dtype(bfloat16)`: float32 on CPUs
    without native bfloat16 (the output is still bfloat16).
    """

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, rows: RowRule | None = None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        self.dtype, self.compute = weight.dtype, compute_dtype(weight.dtype)
        # The batch-size hint only picks the initial blocking: the packed weight serves every batch size.
        w = weight.detach().to(self.compute).contiguous()
        self.packed = torch.ops.mkldnn._reorder_linear_weight(w, 1)
        self.bias = None if bias is None else bias.detach().to(self.compute).contiguous()
        self.rows = rows or RowRule()

    def _product(self, x: torch.Tensor) -> torch.Tensor:
        return _linear(x, self.packed, self.bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        y = self.rows.apply(self._product, x.to(self.compute).contiguous())
        return y if y.dtype == x.dtype else y.to(x.dtype)

    def extra_repr(self) -> str:
        via = "" if self.compute == self.dtype else f", computed in {self.compute}"
        cap = "" if self.rows.cap is None else f", <= {self.rows.cap} rows a call"
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, packed{via}, "
            f"rows%{self.rows.multiple}{cap}"
        )


@functools.cache
def probe_row_rule(in_features: int, out_features: int, dtype: torch.dtype, max_rows: int) -> RowRule:
    """How a packed [out, in] linear's rows are fed so that it is batch-invariant here (cached per shape);
    probed in the dtype the layer computes in (compute_dtype). NotInvariantError where no rule holds."""
    dtype = compute_dtype(dtype)
    g = torch.Generator().manual_seed(0)
    weight = torch.randn(out_features, in_features, generator=g) * in_features**-0.5
    weight, rows = sensitize(weight, torch.randn(max_rows + 8, in_features, generator=g))
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.to(dtype), 1)
    rows = rows.to(dtype)
    return row_rule(
        lambda x: _linear(x.contiguous(), packed, None),
        rows,
        f"packed {dtype} linear {in_features}->{out_features}",
        strict=True,
    )
