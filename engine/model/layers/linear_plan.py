"""`LinearPlan`: how each linear of a model runs once its weights are loaded, decided before the model is built.

The loader reads the files first (is there a GGUF whose blocks run here, which of its tensors have a kernel,
can this CPU run packed oneDNN weights in this dtype) and hands the model one plan at construction. The model
builds its linears as dense `nn.Linear`s (the weights load into them by name), then, once loaded, asks the
plan for each one (`finish`, by its name: 'layers.3.self_attn.qkv_proj', 'lm_head') and keeps what it gets:

- a `QuantLinear` on the GGUF's blocks as stored, where the plan holds its parts (`quantized`);
- else a `PackedLinear` on weights packed for oneDNN, its rows fed as its shape's probe says (`pack`);
- else the dense layer as it is.

So nothing outside the model replaces a module of it: the model applies its own plan. A tied head (the
embedding matrix, `weight` and no `in_features`) is planned like any linear: quantized from the GGUF's
embedding table, or a packed copy of the embedding (the lookup keeps the plain one).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch
from torch import nn

from engine.model.kernels.build import Kernels
from engine.model.kernels.invariance import PROBE_ROWS, RowRule
from engine.model.layers.linear import HEAD_PROBE_ROWS, PackedLinear, probe_row_rule
from engine.model.layers.quant_linear import QuantLinear

HEAD = "lm_head"  # the output head's name in a plan; it is probed on fewer rows (HEAD_PROBE_ROWS)
QuantParts = list[tuple[int, np.ndarray]]  # (GGML type, GGUF rows [out, bytes]) side by side in the output


@dataclass(slots=True)
class LinearPlan:
    """Per linear name, the layer it runs as. The default plan keeps every linear dense."""

    # linear name -> its GGUF parts; each runs as a QuantLinear on `kernels`
    quantized: dict[str, QuantParts] = field(default_factory=dict)
    kernels: Kernels | None = None
    # every other linear runs packed (only where layers.linear.packing_supported)
    pack: bool = False
    # pad a packed linear's rows as its shape's probe says (False: --no-batch-invariant)
    probe: bool = True
    # the quantized linears take Q8 activations (--quantize-activations q8), the head too, as llama.cpp's CPU
    # path does: at one row it is a quarter of a decode step's weights (the default model's 49,152 x 576 Q8_0),
    # 4.97 -> 2.53 ms with q8 on a Zen 1 (AVX2, 2 threads), where a decode step takes ~12.7 ms; the accuracy
    # it costs is in docs/determinism.md#q8-activations
    q8_activations: bool = False

    def __post_init__(self) -> None:
        if self.quantized and self.kernels is None:
            raise ValueError("a plan with quantized linears needs the kernels that run them")

    def finish(self, name: str, dense: nn.Module) -> nn.Module:
        """The layer `name` runs as, from its loaded dense form (an nn.Linear, or a tied head)."""
        weight, bias = dense.weight, getattr(dense, "bias", None)
        if not isinstance(weight, torch.Tensor):
            raise TypeError(f"{name}: a {type(dense).__name__} has no weight to plan from")
        parts = self.quantized.get(name)
        if parts is not None:
            assert self.kernels is not None
            return QuantLinear.of_parts(
                self.kernels, parts, weight.shape[1], bias, q8_activations=self.q8_activations
            )
        if not self.pack:
            return dense
        out_f, in_f = weight.shape
        rows = HEAD_PROBE_ROWS if name == HEAD else PROBE_ROWS[-1]
        rule = probe_row_rule(in_f, out_f, weight.dtype, rows) if self.probe else RowRule()
        return PackedLinear(weight, bias, rule)
