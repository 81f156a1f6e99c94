"""Linear layers that run a GGUF's Q4_1 / Q8_0 weights as stored, with Brine's C++ kernel (csrc/quant_linear.cpp).

Why: decode streams every weight once per token, so its speed is the weights' size. The default model's GGUF
stores its layers in Q4_1 and its (tied) output head in Q8_0: ~96 MB, where the same weights widened to
bfloat16 are ~270 MB plus a 56 MB packed copy of the head. Keeping the blocks as stored makes a decode step
stream a third of the bytes, and the weights are the file's exact values (d * q + m), which bfloat16 could
not hold.

Numerics: the kernel's arithmetic per output is fixed (the kernel's header says how), so a row's result does
not depend on the batch, its place in it, or the thread count: no row padding is needed, unlike the packed
oneDNN linears. Against a float32 product with the dequantized weights it differs only by float32 rounding;
activations stay in the model's dtype, so a bfloat16 model still rounds its activations to bfloat16
between ops as transformers does.

Where it applies: the model came from a GGUF (the converted directory names its source), the device is the
CPU, the dtype is bfloat16 or float32, the CPU has AVX512-BF16 (the kernel reports it), and every part of a
fused layer (q/k/v, gate/up) has the same type, Q4_1 or Q8_0. Any other layer keeps the dense path.
`brine serve --quantization none` (EngineConfig.quantization) turns it off: every layer is then dequantized to the model's dtype.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from torch import nn

from engine.model.config import ModelConfig
from engine.model.gguf_convert import unpermute_rotary
from engine.model.llama import LlamaForCausalLM
from engine.model.native_kernels import FLOAT32_BF16_CODES, Kernels

logger = logging.getLogger(__name__)

# GGML type ids (gguf.GGMLQuantizationType) and what the kernel calls them.
GGML_Q4_1, GGML_Q8_0 = 3, 8
KERNEL_TYPE = {GGML_Q4_1: 0, GGML_Q8_0: 1}
_BLOCK_BYTES = {GGML_Q4_1: 20, GGML_Q8_0: 34}  # per 32 weights, as GGUF stores them
TILE, BLOCK = 16, 32


def repack(raw: np.ndarray, ggml_type: int, in_features: int) -> np.ndarray:
    """GGUF rows [out, bytes per row] -> the kernel's records [tiles, blocks, record bytes] (see the kernel's
    header). Output features are padded to a multiple of 16 with zero weights."""
    n, blocks = raw.shape[0], in_features // BLOCK
    rows = raw.reshape(n, blocks, _BLOCK_BYTES[ggml_type])
    pad = -n % TILE
    if pad:
        rows = np.concatenate([rows, np.zeros((pad, blocks, rows.shape[2]), np.uint8)])
    tiles = rows.shape[0] // TILE

    def per_tile(a: np.ndarray) -> np.ndarray:  # [tiles * 16, blocks, *rest] -> [tiles, blocks, 16, *rest]
        a = a.reshape(tiles, TILE, blocks, *a.shape[2:])
        return np.moveaxis(a, 1, 2)

    d = per_tile(rows[:, :, 0:2]).reshape(tiles, blocks, 2 * TILE)
    if ggml_type == GGML_Q4_1:
        m = per_tile(rows[:, :, 2:4]).reshape(tiles, blocks, 2 * TILE)
        qs = rows[:, :, 4:20]
        q = np.concatenate([qs & 0xF, qs >> 4], axis=-1)  # element j and j + 16 share byte j
        # words[p, 2c + e] = q[c][2p + e]: pair p's vector of 16 columns x (even, odd) inputs
        words = np.moveaxis(per_tile(q).reshape(tiles, blocks, TILE, BLOCK // 2, 2), 2, 3)
        words = words.reshape(tiles, blocks, 4, 4, 4, 8)  # [chunk j, pair 4j + t, 128-bit lane, word in lane]
        # The kernel's unpack order (its comment): byte (j, lane, half, i) = pair 4j + half's word | pair
        # 4j + 2 + half's word << 4, both at word 8 lane + i.
        chunks = words[:, :, :, 0:2] | (words[:, :, :, 2:4] << 4)  # [.., j, half, lane, i]
        pairs = np.swapaxes(chunks, 3, 4).reshape(tiles, blocks, BLOCK // 2 * TILE)
        out = np.concatenate([d, m, pairs], axis=-1)
    else:
        q8 = rows[:, :, 2:34].reshape(rows.shape[0], blocks, BLOCK // 2, 2)  # [n, blocks, pair, 2]
        pairs = np.moveaxis(per_tile(q8), 2, 3).reshape(tiles, blocks, BLOCK * TILE)
        out = np.concatenate([d, pairs], axis=-1)
    return np.ascontiguousarray(out)


class QuantLinear(nn.Module):
    """y = x W^T (+ b) on GGUF blocks repacked for the kernel; a drop-in for the model's linears on [M, in]."""

    fn: Callable[..., int]  # the kernel (ctypes)
    records: torch.Tensor  # [tiles, blocks, record bytes] uint8, a buffer

    def __init__(
        self,
        kernels: Kernels,
        ggml_type: int,
        raw: np.ndarray,
        in_features: int,
        bias: torch.Tensor | None = None,
    ) -> None:
        super().__init__()
        if kernels.quant_linear is None:
            raise ValueError("this CPU has no quantized-linear kernel")
        if in_features % BLOCK:
            raise ValueError(f"in_features {in_features} is not a multiple of {BLOCK}")
        self.fn = kernels.quant_linear
        self.out_features, self.in_features = raw.shape[0], in_features
        self.ggml_type = ggml_type
        self.register_buffer(
            "records", torch.from_numpy(repack(raw, ggml_type, in_features)), persistent=False
        )
        self.bias = None if bias is None else bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [M, in] -> [M, out]
        dtype = FLOAT32_BF16_CODES.get(x.dtype)
        if dtype is None or x.dim() != 2 or x.shape[1] != self.in_features:
            raise ValueError(
                f"QuantLinear takes [M, {self.in_features}] float32 or bfloat16, got {x.dtype} {x.shape}"
            )
        x = x.contiguous()
        m = x.shape[0]
        out = torch.empty(m, self.out_features, dtype=x.dtype)
        rc = self.fn(
            KERNEL_TYPE[self.ggml_type],
            self.records.data_ptr(),
            self.out_features,
            self.in_features,
            dtype,
            x.data_ptr(),
            m,
            self.in_features,
            None if self.bias is None else self.bias.data_ptr(),
            out.data_ptr(),
            self.out_features,
            dtype,
            torch.get_num_threads(),
        )
        if rc:
            raise RuntimeError(f"quantized linear kernel refused its arguments (code {rc})")
        return out

    @property
    def kind(self) -> str:
        return {GGML_Q4_1: "Q4_1", GGML_Q8_0: "Q8_0"}[self.ggml_type]

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, {self.kind}"


# Our fused module -> the GGUF tensors it is made of, in order (q/k rows need llama.cpp's permutation undone).
_LAYER_PARTS = {
    "self_attn.qkv_proj": ("attn_q", "attn_k", "attn_v"),
    "self_attn.o_proj": ("attn_output",),
    "mlp.gate_up_proj": ("ffn_gate", "ffn_up"),
    "mlp.down_proj": ("ffn_down",),
}


def quantize_from_gguf(
    model: LlamaForCausalLM, gguf_path: Path, cfg: ModelConfig, kernels: Kernels
) -> QuantLinear | None:
    """Replace each linear of `model` whose GGUF parts are all Q4_1 or all Q8_0 by a QuantLinear. Returns
    the output head's QuantLinear for a tied head (the embedding lookup keeps its dense table), else None.
    Layers of other types keep their dense weights (logged)."""
    from engine.model.gguf_tensors import read_tensors  # the tensors only: see its docstring

    tensors = read_tensors(gguf_path)
    kept: list[str] = []

    def build(names: list[str], module: nn.Linear, heads: dict[str, int]) -> QuantLinear | None:
        parts = [tensors.get(f"{name}.weight") for name in names]
        types = {None if t is None else int(t.tensor_type) for t in parts}
        if len(types) != 1 or (kind := types.pop()) not in KERNEL_TYPE or module.in_features % BLOCK:
            kept.append(names[0])
            return None
        raws = []
        for name, t in zip(names, parts, strict=True):
            assert t is not None
            raw = np.asarray(t.data).reshape(-1, _BLOCK_BYTES[kind] * module.in_features // BLOCK)
            suffix = name.rsplit(".", 1)[-1]
            raws.append(unpermute_rotary(raw, heads[suffix]) if suffix in heads else raw)
        raw = np.concatenate(raws)
        if raw.shape[0] != module.out_features:
            kept.append(names[0])
            return None
        return QuantLinear(kernels, kind, raw, module.in_features, module.bias)

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
        quant = build(["output"], model.lm_head, {})
        if quant is not None:
            model.lm_head = quant  # type: ignore[assignment]
    elif "output.weight" not in tensors:  # tied: the head is the embedding matrix
        embed = model.embed_tokens
        probe = nn.Linear(embed.embedding_dim, embed.num_embeddings, bias=False, device="meta")
        head = build(["token_embd"], probe, {})
    if kept:
        logger.info(
            "%d linears keep dense weights (types the kernel does not run), e.g. %s", len(kept), kept[0]
        )
    return head
