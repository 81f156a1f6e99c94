"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat batch and a paged KV cache.

Shapes: T = tokens of the whole step (all requests concatenated), H = query heads, Hkv = kv heads,
D = head_dim. The numerics follow transformers' implementation op for op (RMSNorm in float32 then cast,
RoPE cos/sin cast to the model dtype, residual adds in the model dtype), so logits agree closely in every
dtype, not just float32. q/k/v and gate/up are fused into one matmul each.

The native fast paths a layer may take (fused elementwise kernels, the fused RoPE + KV write) are the ones
its architecture declares (`capabilities`, from `registry`); the runner passes the step's state in one
`ForwardContext`, and may hand it a native layer stack that replaces the layer loop. A variant changes one
piece by subclassing: `norm_class` for its norm, `embed` for its embedding.
"""

from __future__ import annotations

from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv_store import write_slots
from engine.model.config import ModelConfig
from engine.model.kernels import fused_ops
from engine.model.layers.activation import silu_and_mul
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import Rotary, apply_rope
from engine.model.models.capabilities import Capabilities
from engine.model.models.context import ForwardContext

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, D / 2] in the model dtype


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, caps: Capabilities, norm_class: type[RMSNorm]) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        fused = caps.fused_elementwise
        self.q_norm = norm_class(cfg.head_dim, cfg.rms_norm_eps, fused) if cfg.qk_norm else None
        self.k_norm = norm_class(cfg.head_dim, cfg.rms_norm_eps, fused) if cfg.qk_norm else None
        self.rope_and_write = caps.rope_and_write
        self.sliding_window = cfg.sliding_windows[layer]
        self.scale = cfg.head_dim**-0.5

    def forward(self, x: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:  # [T, hidden]
        t, h, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        k_cache, v_cache = (
            ctx.k_caches[self.layer],
            ctx.v_caches[self.layer],
        )  # [num_blocks, block_size, Hkv, D]
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        fused = None
        if self.rope_and_write and self.q_norm is None and ctx.backend.reads_keys_from_cache:
            # One native call rotates q and k and writes k and v to the cache, which is all the backend reads.
            fused = fused_ops.rope_and_write(qkv, rope, ctx.slot_mapping, k_cache, v_cache, h)
        if fused is not None:
            q, k, v = fused, qkv[:0], qkv[:0]
        else:
            v = qkv[:, self.q_size + self.kv_size :].view(t, hkv, d)  # [T, Hkv, D]
            if self.q_norm is not None and self.k_norm is not None:
                q = apply_rope(self.q_norm(qkv[:, : self.q_size].view(t, h, d)), *rope)  # [T, H, D]
                k = apply_rope(
                    self.k_norm(qkv[:, self.q_size : self.q_size + self.kv_size].view(t, hkv, d)), *rope
                )
            else:
                # q and k rotate together: one set of elementwise ops instead of two (decode is op-bound).
                qk = apply_rope(qkv[:, : self.q_size + self.kv_size].view(t, h + hkv, d), *rope)
                q, k = qk[:, :h], qk[:, h:]
            # Every token of the step is in the cache before any request attends: a request may read blocks
            # that another request of the same step is filling.
            write_slots(k_cache, v_cache, k, v, ctx.slot_mapping)
        o = ctx.backend.forward(q, k, v, k_cache, v_cache, ctx.plan, self.sliding_window, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig, caps: Capabilities) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.fused = caps.fused_elementwise

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(silu_and_mul(self.gate_up_proj(x), self.fused))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, caps: Capabilities, norm_class: type[RMSNorm]) -> None:
        super().__init__()
        fused = caps.fused_elementwise
        self.input_layernorm = norm_class(cfg.hidden_size, cfg.rms_norm_eps, fused)
        self.self_attn = Attention(cfg, layer, caps, norm_class)
        self.post_attention_layernorm = norm_class(cfg.hidden_size, cfg.rms_norm_eps, fused)
        self.mlp = MLP(cfg, caps)

    def forward(self, h: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        # h: [T, hidden], the residual stream
        x = self.input_layernorm.norm(h)
        attn = self.self_attn(x, rope, ctx)
        h, x = self.post_attention_layernorm.add_norm(h, attn)
        return h + self.mlp(x)


class TiedHead(nn.Module):
    """The output head of a model whose head is its embedding matrix: logits = h E^T.

    A module like any other head, so that the loader can replace it with a packed or quantized copy as it
    replaces every other linear. The embedding is held in a tuple: not registered a second time."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self._embedding = (embedding,)

    @property
    def weight(self) -> torch.Tensor:
        return self._embedding[0].weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids, ctx) -> float32 logits of the rows `ctx.logits_indices` names."""

    norm_class: type[RMSNorm] = RMSNorm  # a variant's norm (Gemma's (1 + w), ...) replaces it

    def __init__(self, cfg: ModelConfig, caps: Capabilities) -> None:
        super().__init__()
        self.cfg = cfg
        self.capabilities = caps
        # Built on the meta device (the loader does, then loads every weight), the table skips its random
        # init: nn.Embedding's normal_ on a meta tensor runs through torch's Python refs, which import
        # torch._dynamo, ~1.2 s of an engine start for nothing.
        table = torch.empty(cfg.vocab_size, cfg.hidden_size) if torch.empty(0).is_meta else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table)
        norm = self.norm_class
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, caps, norm) for i in range(cfg.num_layers))
        self.norm = norm(cfg.hidden_size, cfg.rms_norm_eps, caps.fused_elementwise)
        self.lm_head: nn.Module = (
            TiedHead(self.embed_tokens)
            if cfg.tie_word_embeddings
            else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        self.rotary = Rotary(cfg)

    @property
    def decoder_layers(self) -> list[DecoderLayer]:
        """`layers`, typed (to a type checker an nn.ModuleList holds plain nn.Modules)."""
        return cast(list[DecoderLayer], list(self.layers))

    def embed(self, input_ids: torch.Tensor) -> torch.Tensor:  # [T] -> [T, hidden]
        return self.embed_tokens(input_ids)

    @torch.inference_mode()
    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:  # [N, vocab] float32
        h = self.embed(input_ids)  # [T, hidden]
        rope = self.rotary.lookup(ctx.positions, h.dtype)
        normed = ctx.layer_stack.run(h, rope, ctx) if ctx.layer_stack is not None else None
        if normed is not None:  # every row's final norm (a row's norm is computed alone: same bits)
            h = normed.index_select(0, ctx.logits_indices)
        else:
            for layer in self.layers:
                h = layer(h, rope, ctx)
            # Only the rows that sample (or ask for prompt logprobs) go through the norm and the vocab matmul.
            h = self.norm.norm(h.index_select(0, ctx.logits_indices))
        return self.lm_head(h).float()
