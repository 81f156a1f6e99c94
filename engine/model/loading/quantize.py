"""Which linears of a GGUF-converted model run the file's quantized blocks as stored (`layers.quant_linear`).

The loader calls `quantizable_gguf` (is there a GGUF behind this directory, and can its blocks run here?) and
then `quantized_parts`, before it builds the model: the file's bytes of each fused linear whose GGUF parts all
have a kernel (the q/k rows with llama.cpp's rotary permutation undone), by the linear's name, for the model's
`layers.linear_plan.LinearPlan`. Any other linear keeps its dense weights.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch

from engine.model.config import ModelConfig
from engine.model.kernels.build import load as load_kernels
from engine.model.layers.linear_plan import HEAD, QuantParts
from engine.model.layers.quant_linear import row_bytes, runs_as_stored
from engine.model.loading.gguf_convert import gguf_source, unpermute_rotary
from engine.model.loading.gguf_tensors import read_tensors

logger = logging.getLogger(__name__)


# Our fused module -> the GGUF tensors it is made of, in order (q/k rows need llama.cpp's permutation undone).
_LAYER_PARTS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def quantized_parts(gguf_path: Path, cfg: ModelConfig) -> dict[str, QuantParts]:
    """{linear name: its GGUF parts} for each linear of the model `cfg` describes whose GGUF parts all have a
    kernel, the output head included (a tied head too: the embedding lookup keeps its dense table). Linears
    of other types are left out: they keep dense weights (logged)."""
    tensors = read_tensors(gguf_path)
    kept: list[str] = []

    def build(
        names: list[str], in_features: int, out_features: int, heads: dict[str, int]
    ) -> QuantParts | None:
        parts = [tensors.get(f"{name}.weight") for name in names]
        if any(t is None or not runs_as_stored(int(t.tensor_type), in_features) for t in parts):
            kept.append(names[0])
            return None
        # Neighbouring parts of one type are one part (one kernel call); a type change starts another.
        runs: list[tuple[int, list[np.ndarray]]] = []
        for name, t in zip(names, parts, strict=True):
            assert t is not None
            kind = int(t.tensor_type)
            raw = np.asarray(t.data).reshape(-1, row_bytes(kind, in_features))
            suffix = name.rsplit(".", 1)[-1]
            raw = unpermute_rotary(raw, heads[suffix]) if suffix in heads else raw
            if runs and runs[-1][0] == kind:
                runs[-1][1].append(raw)
            else:
                runs.append((kind, [raw]))
        joined = [(kind, np.concatenate(raws)) for kind, raws in runs]
        if sum(raw.shape[0] for _, raw in joined) != out_features:
            kept.append(names[0])
            return None
        return joined

    heads = {"attn_q": cfg.num_heads, "attn_k": cfg.num_kv_heads}
    q, kv = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
    shapes = {  # our linear -> (in_features, out_features)
        "self_attn.qkv_proj": (cfg.hidden_size, q + 2 * kv),
        "self_attn.o_proj": (q, cfg.hidden_size),
        "mlp.gate_up_proj": (cfg.hidden_size, 2 * cfg.intermediate_size),
        "mlp.down_proj": (cfg.intermediate_size, cfg.hidden_size),
    }
    plan: dict[str, QuantParts] = {}
    for i in range(cfg.num_layers):
        for ours, parts in _LAYER_PARTS.items():
            quant = build([f"blk.{i}.{p}" for p in parts], *shapes[ours], heads)
            if quant is not None:
                plan[f"layers.{i}.{ours}"] = quant
    head: QuantParts | None = None
    if not cfg.tie_word_embeddings:
        head = build(["output"], cfg.hidden_size, cfg.vocab_size, {})
    elif "output.weight" not in tensors:  # the embedding matrix
        head = build(["token_embd"], cfg.hidden_size, cfg.vocab_size, {})
    if head is not None:
        plan[HEAD] = head
    if kept:
        logger.info(
            "%d linears keep dense weights (types the kernel does not run), e.g. %s", len(kept), kept[0]
        )
    return plan


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
