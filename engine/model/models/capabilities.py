"""What an architecture declares about its native fast paths (`registry` holds each architecture's).

A native path computes a piece of the model in C++ instead of the Python code that defines it. It matches
that code only where the architecture's Python is Llama's for that piece, and no runtime check can tell (a
subclass that changes one line of a norm looks the same from outside). So each architecture says which
paths it matches, and nothing else runs natively: a new entry declares none until its author has checked
them, and its Python runs as written.
"""

from __future__ import annotations

from dataclasses import dataclass, fields


@dataclass(frozen=True, slots=True)
class Capabilities:
    # RMSNorm, the residual add fused with it, and silu(gate) * up as one native call each (kernels.fused_ops)
    fused_elementwise: bool = False
    # RoPE on q and k and the k/v write into the cache as one native call (kernels.fused_ops.rope_and_write)
    rope_and_write: bool = False
    # every decoder layer in one native call per step (models.native_stack): Llama's layer, op for op
    native_stack: bool = False
    # a GGUF's quantized blocks run as stored (layers.quant_linear), mapped by Llama's GGUF tensor names
    quantized_linears: bool = False

    def describe(self) -> str:
        """The declared paths, for the startup log: 'fused_elementwise, rope_and_write' or 'none'."""
        names = [f.name for f in fields(self) if getattr(self, f.name)]
        return ", ".join(names) or "none"


# Llama's own layers: every path was written against them.
ALL = Capabilities(fused_elementwise=True, rope_and_write=True, native_stack=True, quantized_linears=True)
