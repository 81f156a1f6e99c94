"""Tiny LoRA adapters written in PEFT's file layout (adapter_config.json + adapter_model.safetensors), with
random A and B, for any Llama-family shape; and the merged-weight delta a reference applies."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import save_file

ALL_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def target_shapes(
    hidden: int, heads: int, kv_heads: int, head_dim: int, inter: int
) -> dict[str, tuple[int, int]]:
    """target -> (in, out) of a Llama decoder layer's linears."""
    q, kv = heads * head_dim, kv_heads * head_dim
    return {
        "q_proj": (hidden, q),
        "k_proj": (hidden, kv),
        "v_proj": (hidden, kv),
        "o_proj": (q, hidden),
        "gate_proj": (hidden, inter),
        "up_proj": (hidden, inter),
        "down_proj": (inter, hidden),
    }


def default_model_shapes() -> tuple[int, dict[str, tuple[int, int]]]:
    """(layers, shapes) of the default model (SmolLM2-135M: 30 layers, 576 hidden, 9 heads of 64, 3 kv)."""
    return 30, target_shapes(576, 9, 3, 64, 1536)


def write_adapter(
    path: Path,
    num_layers: int,
    shapes: dict[str, tuple[int, int]],
    *,
    rank: int = 8,
    alpha: float = 16.0,
    seed: int = 0,
    targets: tuple[str, ...] = ALL_TARGETS,
    std: float = 0.02,
) -> Path:
    """A random adapter at `path` (created), every layer's `targets`; returns `path`."""
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(num_layers):
        for t in targets:
            in_f, out_f = shapes[t]
            part = "self_attn" if t in ("q_proj", "k_proj", "v_proj", "o_proj") else "mlp"
            key = f"base_model.model.model.layers.{layer}.{part}.{t}"
            tensors[f"{key}.lora_A.weight"] = torch.randn(rank, in_f, generator=g) * std
            tensors[f"{key}.lora_B.weight"] = torch.randn(out_f, rank, generator=g) * std
    path.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    config = {
        "peft_type": "LORA",
        "r": rank,
        "lora_alpha": alpha,
        "target_modules": list(targets),
        "bias": "none",
        "lora_dropout": 0.0,
        "task_type": "CAUSAL_LM",
    }
    (path / "adapter_config.json").write_text(json.dumps(config))
    return path
