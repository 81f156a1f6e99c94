"""bfloat16 linear layers on CPU with their weights pre-packed once into oneDNN's blocked layout.

A bfloat16 `F.linear` on CPU hands oneDNN a row-major weight, which it reorders on every call; decode
streams every weight once per step, so that work is paid per layer per token. Packing once at load time (what
inductor's weight freezing does) lets the kernel stream the weights as stored: on this project's 2-core EPYC
(AVX512-BF16) single matmuls of SmolLM2-135M's shapes ran 1.4-2.3x faster at 1 and 16 rows, a whole decode
step ~1.4x faster (benchmarks/decode_bench.py --baseline), prefill a few percent. The result is
bit-identical to `F.linear` (same oneDNN kernels, same accumulation order), which `pack_linears` checks on a
probe before switching a model over.

Only bfloat16 on CPU: a float32 `F.linear` runs MKL's sgemm, whose rounding oneDNN does not reproduce, and
CUDA has nothing to pack. A packed weight is an opaque `torch._mkldnn` tensor: the model cannot be moved or
cast afterwards, which is why packing is the last step of loading. A tied output head gets its own packed
copy of the embedding matrix (the lookup needs the plain one): 56 MB more for the default model.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger(__name__)


def packing_supported(device: torch.device, dtype: torch.dtype) -> bool:
    """True where this torch build can run bfloat16 linears on packed oneDNN weights."""
    if device.type != "cpu" or dtype != torch.bfloat16 or not torch.backends.mkldnn.is_available():
        return False
    ops = torch.ops.mkldnn
    try:
        return (
            hasattr(ops, "_reorder_linear_weight")
            and hasattr(ops, "_linear_pointwise")
            and bool(ops._is_mkldnn_bf16_supported())
        )
    except (AttributeError, RuntimeError):  # pragma: no cover - builds without these ops
        return False


class PackedLinear(nn.Module):
    """y = x W^T + b with W held packed; a drop-in for a bfloat16 `nn.Linear` at inference."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
        super().__init__()
        self.out_features, self.in_features = weight.shape
        # The batch-size hint only picks the initial blocking: the packed weight serves every batch size.
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), 1)
        self.bias = None if bias is None else bias.detach().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        return torch.ops.mkldnn._linear_pointwise(x.contiguous(), self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed"


def _agrees(linear: PackedLinear, weight: torch.Tensor, bias: torch.Tensor | None) -> bool:
    probe = torch.randn(3, weight.shape[1], generator=torch.Generator().manual_seed(0)).to(weight.dtype)
    with torch.inference_mode():
        return torch.equal(linear(probe), F.linear(probe, weight, bias))


def pack_linears(model: nn.Module, tied_head: torch.Tensor | None = None) -> PackedLinear | None:
    """Replace every `nn.Linear` of `model` by a `PackedLinear` in place.

    `tied_head`: the embedding matrix of a model whose output head reuses it; it gets a packed copy (the
    embedding lookup still needs the plain one), which is returned. Call only where `packing_supported`.
    If the first packed layer does not reproduce `F.linear` exactly, nothing is changed and a warning says so.
    """
    linears = [(parent, name, child) for parent in model.modules() for name, child in parent.named_children()]
    linears = [(p, n, c) for p, n, c in linears if isinstance(c, nn.Linear)]
    if linears:
        _, _, first = linears[0]
        if not _agrees(PackedLinear(first.weight, first.bias), first.weight, first.bias):
            logger.warning("packed oneDNN linear differs from F.linear on this machine: not packing")
            return None
    for parent, name, child in linears:
        setattr(parent, name, PackedLinear(child.weight, child.bias))
    return None if tied_head is None else PackedLinear(tied_head, None)
