"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat batch and a paged KV cache.

Shapes: T = tokens of the whole step (all requests concatenated), H = query heads, Hkv = kv heads,
D = head_dim. The numerics follow transformers' implementation op for op (RMSNorm in float32 then cast,
RoPE cos/sin cast to the model dtype, residual adds in the model dtype), so logits agree closely in every
dtype, not just float32. q/k/v and gate/up are fused into one matmul each.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv_store import write_slots
from engine.model.attention.base import AttentionBackend, AttentionMetadata
from engine.model.attention.sdpa import SdpaBackend
from engine.model.config import ModelConfig
from engine.model.kernels import fused_ops
from engine.model.layers.activation import silu
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import Rotary, apply_rope

if TYPE_CHECKING:
    from engine.model.models.native_stack import NativeStack


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj = nn.Linear(cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps) if cfg.qk_norm else None
        self.sliding_window = cfg.sliding_windows[layer]
        self.scale = cfg.head_dim**-0.5

    def forward(
        self,
        x: torch.Tensor,  # [T, hidden]
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, 1, D / 2]
        backend: AttentionBackend,
        plan: object,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,
    ) -> torch.Tensor:
        t, h, hkv, d = x.shape[0], self.num_heads, self.num_kv_heads, self.head_dim
        qkv = self.qkv_proj(x)  # [T, (H + 2 Hkv) D]
        fused = None
        if self.q_norm is None and getattr(backend, "reads_keys_from_cache", False):
            # One native call rotates q and k and writes k and v to the cache, which is all the backend reads.
            fused = fused_ops.rope_and_write(qkv, rope, slot_mapping, k_cache, v_cache, h)
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
            write_slots(k_cache, v_cache, k, v, slot_mapping)
        o = backend.forward(q, k, v, k_cache, v_cache, plan, self.sliding_window, self.scale)
        return self.o_proj(o.reshape(t, self.q_size))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(fused_ops.silu_mul(self.gate_up_proj(x), silu))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)

    def forward(
        self,
        h: torch.Tensor,  # [T, hidden]: the residual stream
        rope: tuple[torch.Tensor, torch.Tensor],
        backend: AttentionBackend,
        plan: object,
        slot_mapping: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
    ) -> torch.Tensor:  # [T, hidden]
        x = fused_ops.rms_norm(h, self.input_layernorm)
        attn = self.self_attn(x, rope, backend, plan, slot_mapping, k_cache, v_cache)
        h, x = fused_ops.add_rms_norm(h, attn, self.post_attention_layernorm)
        return h + self.mlp(x)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids, positions, meta, k_caches, v_caches, logits_indices) -> float32 logits."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        # Built on the meta device (the loader does, then loads every weight), the table skips its random
        # init: nn.Embedding's normal_ on a meta tensor runs through torch's Python refs, which import
        # torch._dynamo, ~1.2 s of an engine start for nothing.
        table = torch.empty(cfg.vocab_size, cfg.hidden_size) if torch.empty(0).is_meta else None
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size, _weight=table)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.lm_head = (
            None if cfg.tie_word_embeddings else nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        )
        # Set by cpu_linear.pack_linears for a tied head: a packed copy of embed_tokens.weight.
        self.packed_lm_head: nn.Module | None = None
        self.rotary = Rotary(cfg)
        self.attn_backend: AttentionBackend = SdpaBackend(torch.device("cpu"))
        # Set by the runner where every layer's pieces run natively: the layers in one call per step.
        self.native_stack: NativeStack | None = None

    @torch.inference_mode()
    def forward(
        self,
        input_ids: torch.Tensor,  # [T]
        positions: torch.Tensor,  # [T]
        meta: AttentionMetadata,
        k_caches: list[torch.Tensor],
        v_caches: list[torch.Tensor],
        logits_indices: torch.Tensor,  # [N]: rows of the batch whose next-token logits are wanted
    ) -> torch.Tensor:  # [N, vocab] float32
        backend = self.attn_backend
        plan = backend.plan(meta)
        h = self.embed_tokens(input_ids)  # [T, hidden]
        rope = self.rotary.lookup(positions, h.dtype)
        stack = self.native_stack
        normed = (
            stack.run(h, rope, plan, meta.slot_mapping, k_caches, v_caches) if stack is not None else None
        )
        if normed is not None:  # every row's final norm (a row's norm is computed alone: same bits)
            h = normed.index_select(0, logits_indices)
        else:
            for i, layer in enumerate(self.layers):
                h = layer(h, rope, backend, plan, meta.slot_mapping, k_caches[i], v_caches[i])
            # Only the rows that sample (or ask for prompt logprobs) go through the norm and the vocab matmul.
            h = fused_ops.rms_norm(h.index_select(0, logits_indices), self.norm)
        if self.packed_lm_head is not None:
            return self.packed_lm_head(h).float()
        if self.lm_head is not None:
            return self.lm_head(h).float()
        return F.linear(h, self.embed_tokens.weight).float()
