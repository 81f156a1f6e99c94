"""The architectures Brine runs: name (config.json's `architectures[0]`) -> the model class built for it and
the native paths it declares (`capabilities`).

How a checkpoint's config.json is read for each architecture (biases, q/k norms, sliding windows, tensor
renames) is `config.ARCHITECTURES`; this is what runs it. A new Llama-like architecture is an entry in both,
and, where its Python differs from Llama's, a subclass of `LlamaForCausalLM` that changes that one thing. It
declares only the native paths whose code it has checked against its own: the runner runs the others from
Python, so a change it makes is never skipped on CPU.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.model.config import UnsupportedModelError
from engine.model.models.capabilities import ALL, Capabilities
from engine.model.models.llama import LlamaForCausalLM


@dataclass(frozen=True, slots=True)
class ModelSpec:
    model_class: type[LlamaForCausalLM]
    capabilities: Capabilities


MODELS: dict[str, ModelSpec] = {
    "LlamaForCausalLM": ModelSpec(LlamaForCausalLM, ALL),
    "MistralForCausalLM": ModelSpec(LlamaForCausalLM, ALL),
    "Qwen2ForCausalLM": ModelSpec(LlamaForCausalLM, ALL),
    # Qwen3's q/k norms sit between the projection and RoPE: neither the fused RoPE + write nor the stack
    # computes them.
    "Qwen3ForCausalLM": ModelSpec(
        LlamaForCausalLM, Capabilities(fused_elementwise=True, quantized_linears=True)
    ),
}


def lookup(architecture: str) -> ModelSpec:
    """The spec of `architecture`; UnsupportedModelError where none is registered."""
    spec = MODELS.get(architecture)
    if spec is None:
        raise UnsupportedModelError(
            f"architecture {architecture!r} has no model class; registered: {', '.join(MODELS)}"
        )
    return spec
