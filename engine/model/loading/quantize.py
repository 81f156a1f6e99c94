"""Which linears of a GGUF-converted model run the file's quantized blocks as stored (`layers.quant_linear`).

The loader calls `quantizable_gguf` (is there a GGUF behind this directory, and can its blocks run here?) and
then `quantize_from_gguf`, which swaps each fused linear whose GGUF parts all have a kernel for a QuantLinear
built from the file's bytes (the q/k rows with llama.cpp's rotary permutation undone). Any other linear keeps
its dense weights.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.model.config import ModelConfig
from engine.model.kernels.build import Kernels
from engine.model.kernels.build import load as load_kernels
from engine.model.layers.quant_linear import QuantLinear, row_bytes, runs_as_stored
from engine.model.loading.gguf_convert import gguf_source, unpermute_rotary
from engine.model.loading.gguf_tensors import read_tensors
from engine.model.models.llama import LlamaForCausalLM, TiedHead

logger = logging.getLogger(__name__)


# Our fused module -> the GGUF tensors it is made of, in order (q/k rows need llama.cpp's permutation undone).
_LAYER_PARTS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def quantize_from_gguf(model: LlamaForCausalLM, gguf_path: Path, cfg: ModelConfig, kernels: Kernels) -> None:
    """Replace each linear of `model` whose GGUF parts all have a kernel by a QuantLinear, the output head
    included (a tied head too: the embedding lookup keeps its dense table). Layers of other types keep their
    dense weights (logged)."""
    tensors = read_tensors(gguf_path)
    kept: list[str] = []

    def build(names: list[str], module: nn.Linear, heads: dict[str, int]) -> QuantLinear | None:
        parts = [tensors.get(f"{name}.weight") for name in names]
        if any(t is None or not runs_as_stored(int(t.tensor_type), module.in_features) for t in parts):
            kept.append(names[0])
            return None
        # Neighbouring parts of one type are one part (one kernel call); a type change starts another.
        runs: list[tuple[int, list[np.ndarray]]] = []
        for name, t in zip(names, parts, strict=True):
            assert t is not None
            kind = int(t.tensor_type)
            raw = np.asarray(t.data).reshape(-1, row_bytes(kind, module.in_features))
            suffix = name.rsplit(".", 1)[-1]
            raw = unpermute_rotary(raw, heads[suffix]) if suffix in heads else raw
            if runs and runs[-1][0] == kind:
                runs[-1][1].append(raw)
            else:
                runs.append((kind, [raw]))
        joined = [(kind, np.concatenate(raws)) for kind, raws in runs]
        if sum(raw.shape[0] for _, raw in joined) != module.out_features:
            kept.append(names[0])
            return None
        return QuantLinear.of_parts(kernels, joined, module.in_features, module.bias)

    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
    for i, layer in enumerate(model.layers):
        for ours, parts in _LAYER_PARTS.items():
            owner_name, attr = ours.split(".")
            owner = getattr(layer, owner_name)
            module = getattr(owner, attr)
            if not isinstance(module, nn.Linear):
                continue
            quant = build([f"blk.{i}.{p}" for p in parts], module, heads)
            if quant is not None:
                setattr(owner, attr, quant)
    head: QuantLinear | None = None
    if isinstance(model.lm_head, nn.Linear):
        head = build(["output"], model.lm_head, {})
    elif isinstance(model.lm_head, TiedHead) and "output.weight" not in tensors:  # the embedding matrix
        embed = model.embed_tokens
        probe = nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False, device="meta")
        head = build(["token_embd"], probe, {})
    if head is not None:
        model.lm_head = head
    if kept:
        logger.info(
            "%d linears keep dense weights (types the kernel does not run), e.g. %s", len(kept), kept[0]
        )


def quantizable_gguf(model_dir: Path, device: torch.device, dtype: torch.dtype) -> Path | None:
    """The GGUF that `model_dir` was converted from, where its quantized weights can run as stored here:
    on the CPU, in bfloat16 or float32, where Brine's kernels build (every CPU tier has the quantized linear).
    None otherwise (logged)."""
    source = gguf_source(model_dir)
    if source is None or device.type != "cpu" or dtype not in (torch.bfloat16, torch.float32):
        return None
    kernels, why = load_kernels()
    if kernels is None or kernels.quant_linear is None:
        logger.warning(
            "%s: its quantized weights are dequantized to %s: %s",
            source.name,
            dtype,
            why or "these kernels have no quantized linear",
        )
        return None
    return source
