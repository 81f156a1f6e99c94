"""The Llama-family decoder (Llama, Mistral, Qwen2, Qwen3) over a flat batch and a paged KV cache.

Shapes: T = tokens of the whole step (all requests concatenated), H = query heads, Hkv = kv heads,
D = head_dim. The numerics follow transformers' implementation op for op (RMSNorm in float32 then cast,
RoPE cos/sin cast to the model dtype, residual adds in the model dtype), so logits agree closely in every
dtype, not just float32. q/k/v and gate/up are fused into one matmul each.

The native fast paths a layer may take (fused elementwise kernels, the fused RoPE + KV write) are the ones
its architecture declares (`capabilities`, from `registry`); the runner passes the step's state in one
`ForwardContext`, and may hand it a native layer stack that replaces the layer loop. A variant changes one
piece by subclassing: `norm_class` for its norm, `embed` for its embedding.

The model builds its own linears: dense at construction (the loader fills their weights by name), then, in
`finish_loading`, as the `LinearPlan` it was built with says (quantized, packed or dense), and wrapped for
LoRA by `enable_lora`. Each module replaces only its own children: nothing outside sets attributes on it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import cast

import torch
import torch.nn.functional as F
from torch import nn

from engine.kv_store import write_slots
from engine.model.config import ModelConfig
from engine.model.kernels import fused_ops
from engine.model.layers.activation import silu_and_mul
from engine.model.layers.linear_plan import HEAD, LinearPlan
from engine.model.layers.lora import LoRALinear, LoRAStep
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import Rotary, apply_rope
from engine.model.models.capabilities import Capabilities
from engine.model.models.context import ForwardContext

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin: [T, 1, D / 2] in the model dtype
# (a linear's name in its module, the linear) -> the layer to run in its place
Rebuild = Callable[[str, nn.Module], nn.Module]


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, layer: int, caps: Capabilities, norm_class: type[RMSNorm]) -> None:
        super().__init__()
        self.layer = layer
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
        self.q_size, self.kv_size = cfg.num_heads * cfg.head_dim, cfg.num_kv_heads * cfg.head_dim
        self.qkv_proj: nn.Module = nn.Linear(
            cfg.hidden_size, self.q_size + 2 * self.kv_size, bias=cfg.qkv_bias
        )
        self.o_proj: nn.Module = nn.Linear(self.q_size, cfg.hidden_size, bias=cfg.o_bias)
        fused = caps.fused_elementwise
        self.q_norm = norm_class(cfg.head_dim, cfg.rms_norm_eps, fused) if cfg.qk_norm else None
        self.k_norm = norm_class(cfg.head_dim, cfg.rms_norm_eps, fused) if cfg.qk_norm else None
        self.rope_and_write = caps.rope_and_write
        self.sliding_window = cfg.sliding_windows[layer]
        self.scale = cfg.head_dim**-0.5

    def rebuild_linears(self, rebuild: Rebuild) -> None:
        self.qkv_proj = rebuild("qkv_proj", self.qkv_proj)
        self.o_proj = rebuild("o_proj", self.o_proj)

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
        self.gate_up_proj: nn.Module = nn.Linear(
            cfg.hidden_size, 2 * cfg.intermediate_size, bias=cfg.mlp_bias
        )
        self.down_proj: nn.Module = nn.Linear(cfg.intermediate_size, cfg.hidden_size, bias=cfg.mlp_bias)
        self.fused = caps.fused_elementwise

    def rebuild_linears(self, rebuild: Rebuild) -> None:
        self.gate_up_proj = rebuild("gate_up_proj", self.gate_up_proj)
        self.down_proj = rebuild("down_proj", self.down_proj)

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

    def rebuild_linears(self, rebuild: Rebuild) -> None:
        """Each of its linears replaced by `rebuild(name, linear)`, named as in the module tree
        ('self_attn.qkv_proj', ...)."""
        self.self_attn.rebuild_linears(lambda name, linear: rebuild(f"self_attn.{name}", linear))
        self.mlp.rebuild_linears(lambda name, linear: rebuild(f"mlp.{name}", linear))

    def forward(self, h: torch.Tensor, rope: Rope, ctx: ForwardContext) -> torch.Tensor:
        # h: [T, hidden], the residual stream
        x = self.input_layernorm.norm(h)
        attn = self.self_attn(x, rope, ctx)
        h, x = self.post_attention_layernorm.add_norm(h, attn)
        return h + self.mlp(x)


class TiedHead(nn.Module):
    """The output head of a model whose head is its embedding matrix: logits = h E^T.

    A module like any other head, so that the model's `LinearPlan` can make it a packed or quantized copy as
    it does every other linear. The embedding is held in a tuple: not registered a second time."""

    def __init__(self, embedding: nn.Embedding) -> None:
        super().__init__()
        self._embedding = (embedding,)

    @property
    def weight(self) -> torch.Tensor:
        return self._embedding[0].weight

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        return F.linear(h, self.weight)


def _finish_named(plan: LinearPlan, prefix: str, name: str, linear: nn.Module) -> nn.Module:
    return plan.finish(f"{prefix}.{name}", linear)


class LlamaForCausalLM(nn.Module):
    """forward(input_ids, ctx) -> float32 logits of the rows `ctx.logits_indices` names."""

    norm_class: type[RMSNorm] = RMSNorm  # a variant's norm (Gemma's (1 + w), ...) replaces it

    def __init__(self, cfg: ModelConfig, caps: Capabilities, linears: LinearPlan | None = None) -> None:
        """`linears`: how the linears run once loaded (`finish_loading`); None keeps them dense."""
        super().__init__()
        self.cfg = cfg
        self.capabilities = caps
        self._linear_plan: LinearPlan | None = linears if linears is not None else LinearPlan()
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

    def finish_loading(self, device: torch.device) -> None:
        """Called once every weight is loaded: builds the rotary tables, makes each linear what the plan says
        (the plan is then dropped: a quantized layer keeps its own records, not the file's bytes), and
        switches to inference mode."""
        plan = self._linear_plan
        if plan is None:
            raise RuntimeError("finish_loading runs once, after the weights are loaded")
        self._linear_plan = None
        self.rotary.build(device)
        for i, layer in enumerate(self.decoder_layers):
            prefix = f"layers.{i}"
            layer.rebuild_linears(functools.partial(_finish_named, plan, prefix))
        self.lm_head = plan.finish(HEAD, self.lm_head)
        self.eval()

    def enable_lora(self, step: LoRAStep) -> int:
        """Wraps every decoder layer's q/k/v, o, gate/up and down linears for LoRA (each reads the step's row
        groups from `step`); returns how many. The output head and the embedding take no adapter."""
        wrapped: list[LoRALinear] = []
        for i, layer in enumerate(self.decoder_layers):

            def wrap(name: str, linear: nn.Module, i: int = i) -> nn.Module:
                wrapped.append(LoRALinear(linear, i, name.rsplit(".", 1)[-1], step))
                return wrapped[-1]

            layer.rebuild_linears(wrap)
        return len(wrapped)

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
        if normed is not None:  # the final norm of the rows that sample or ask for prompt logprobs
            h = normed
        else:
            hook = ctx.between_layers
            for i, layer in enumerate(self.layers):
                if i and hook is not None:
                    hook()
                h = layer(h, rope, ctx)
            # Only the rows that sample (or ask for prompt logprobs) go through the norm and the vocab matmul.
            h = self.norm.norm(h.index_select(0, ctx.logits_indices))
        return self.lm_head(h).float()
