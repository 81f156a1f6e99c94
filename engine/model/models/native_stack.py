"""The decoder layers of a step as one native call (kernels/csrc/decoder_stack.cpp), where every piece has a kernel.

Why: with quantized linears, fused elementwise kernels and the native attention, a layer is ~10 kernel calls,
and on one row each call's Python side (module dispatch, allocation, ctypes' argument conversion) cost about
as much as its arithmetic: a fifth of a decode step (benchmarks/profile_step.py shows it). The stack runs the same kernels in the same order
on the same arguments, from C, on scratch kept from step to step; the bits are those of the Python path, which
stays for everything else (CUDA, float16, Qwen3's q/k norms, dense linears, other attention backends).

`NativeStack.build(model, backend)` says whether it applies (None, with the reason, where not); the runner
builds one only where the architecture declares `native_stack` (models.registry), since the stack runs Llama's
layer as written here and would skip any change a variant makes in Python. `run()` replaces the layer loop of
`LlamaForCausalLM.forward` (the runner hands it over in the step's ForwardContext) and returns the final norm
of every row. Where the context carries `between_layers`, the layers run one call per layer with the hook
called between them (the same kernels in the same order: the same bits); the hook may run another step's
`run()` meanwhile, so each call builds its own argument record and takes a scratch buffer no other call holds.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable, Sequence

import torch

from engine.model.attention.base import AttentionBackend
from engine.model.attention.native import NativeBackend, NativePlan
from engine.model.kernels.build import DTYPE_CODES, FLOAT32_BF16_CODES, kv_dtype_runs, load
from engine.model.layers.quant_linear import QuantLinear
from engine.model.models.context import ForwardContext
from engine.model.models.llama import LlamaForCausalLM

_I64, _F64, _P = ctypes.c_int64, ctypes.c_double, ctypes.c_void_p


class _Part(ctypes.Structure):
    _fields_ = [("records", _P), ("wtype", _I64), ("n", _I64)]


class _Linear(ctypes.Structure):
    _fields_ = [("parts", _Part * 3), ("num_parts", _I64), ("bias", _P)]


class _Layer(ctypes.Structure):
    _fields_ = [
        ("input_norm", _P),
        ("post_norm", _P),
        ("qkv", _Linear),
        ("o", _Linear),
        ("gate_up", _Linear),
        ("down", _Linear),
        ("k_cache", _P),
        ("v_cache", _P),
        ("window", _I64),
    ]


class _Args(ctypes.Structure):
    _fields_ = [
        *((name, _I64) for name in ("dtype", "kv_dtype", "num_layers", "hidden", "heads", "kv_heads")),
        ("head_dim", _I64),
        ("intermediate", _I64),
        ("block_size", _I64),
        ("eps", _F64),
        ("scale", _F64),
        ("layers", ctypes.POINTER(_Layer)),
        ("final_norm", _P),
        ("tokens", _I64),
        *((name, _P) for name in ("h", "x", "cos", "sin", "slots", "items")),
        ("num_items", _I64),
        ("tables", _P),
        ("table_width", _I64),
        ("causal", _I64),
        *((name, _P) for name in ("qkv", "q", "o", "attn", "gate_up", "act", "mlp")),
        ("threads", _I64),
        ("first_layer", _I64),
        ("end_layer", _I64),
        ("keep", _P),
        ("num_keep", _I64),
        ("keep_items", _P),
        ("num_keep_items", _I64),
    ]


def _linear(module: torch.nn.Module) -> _Linear:
    assert isinstance(module, QuantLinear)
    bias = module.bias.data_ptr() if module.bias is not None else None
    parts = [_Part(records.data_ptr(), wtype, n) for records, wtype, n in module.part_records()]
    return _Linear((_Part * 3)(*parts), len(parts), bias)


class NativeStack:
    def __init__(self, model: LlamaForCausalLM, fn: Callable[..., int]) -> None:
        cfg = model.cfg
        self.fn = fn
        self.dtype = model.embed_tokens.weight.dtype
        self.hidden, self.heads, self.kv_heads = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads
        self.head_dim, self.intermediate = cfg.head_dim, cfg.intermediate_size
        self.layers = (_Layer * cfg.num_layers)()
        for i, layer in enumerate(model.decoder_layers):
            attn, mlp = layer.self_attn, layer.mlp
            self.layers[i] = _Layer(
                layer.input_layernorm.weight.data_ptr(),
                layer.post_attention_layernorm.weight.data_ptr(),
                _linear(attn.qkv_proj),
                _linear(attn.o_proj),
                _linear(mlp.gate_up_proj),
                _linear(mlp.down_proj),
                None,
                None,
                attn.sliding_window or 0,
            )
        self._caches: tuple[int, ...] = ()  # the cache pointers the layers were last given
        # Scratch buffers that no running call holds, kept from one step to the next (see _take_scratch)
        self._spare: list[torch.Tensor] = []
        self.args = _Args(
            FLOAT32_BF16_CODES[self.dtype],
            FLOAT32_BF16_CODES[self.dtype],  # kv_dtype: set per call from the caches
            cfg.num_layers,
            self.hidden,
            self.heads,
            self.kv_heads,
            self.head_dim,
            self.intermediate,
            0,
            cfg.rms_norm_eps,
            cfg.head_dim**-0.5,
            self.layers,
            model.norm.weight.data_ptr(),
        )

    @classmethod
    def build(cls, model: LlamaForCausalLM, backend: AttentionBackend) -> tuple[NativeStack | None, str]:
        """(the stack, "") where every piece of every layer runs natively with `backend`, else (None, why
        not). The caller checks first that the architecture declares the stack."""
        kernels, why = load()
        if kernels is None or kernels.decoder_stack is None:
            return None, why or "no decoder-stack kernel on this CPU"
        cfg = model.cfg
        dtype = model.embed_tokens.weight.dtype
        if model.embed_tokens.weight.device.type != "cpu" or dtype not in FLOAT32_BF16_CODES:
            return None, f"runs on CPU in float32 or bfloat16, not {dtype}"
        if not isinstance(backend, NativeBackend):
            return None, f"attention backend {backend.name}"
        if cfg.qk_norm:
            return None, "q/k norms"
        for layer in model.decoder_layers:
            linears = (
                layer.self_attn.qkv_proj,
                layer.self_attn.o_proj,
                layer.mlp.gate_up_proj,
                layer.mlp.down_proj,
            )
            if not all(isinstance(m, QuantLinear) for m in linears):
                return None, "dense linears"
        norms = [
            model.norm,
            *(n for ly in model.decoder_layers for n in (ly.input_layernorm, ly.post_attention_layernorm)),
        ]
        if any(n.weight.dtype != dtype for n in norms):
            return None, "norm weights in another dtype"
        return cls(model, kernels.decoder_stack), ""

    def run(
        self,
        h: torch.Tensor,  # [T, hidden]: the embeddings
        rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, 1, D / 2] in the model dtype
        ctx: ForwardContext,
    ) -> torch.Tensor | None:
        """The final norm of the last hidden state of the rows `ctx.logits_indices` names [N, hidden], or None
        where this step is not one the stack runs (the caller then runs the layers itself).

        Where the context has those rows on the host (`logits_rows`), strictly increasing and fewer than the
        step's (a prompt, or its chunk, wants one row or none), the last layer computes every row's keys and
        values and the rest only for them. A cold 2,029-token prompt to the default model then skips the last
        of its 30 layers but the keys and values for all rows but one: 1.03x faster in process (bfloat16 on a
        Zen 4 EPYC, and its AVX2 build in float32). Every kernel here computes a row alone, so a kept row's
        bits are those of the full layer's."""
        plan, slot_mapping, k_caches, v_caches = ctx.plan, ctx.slot_mapping, ctx.k_caches, ctx.v_caches
        kv_dtype = k_caches[0].dtype
        if (
            not isinstance(plan, NativePlan)
            or h.dtype != self.dtype
            or not kv_dtype_runs(self.dtype, kv_dtype)
        ):
            return None
        t, d = h.shape[0], self.head_dim
        caches = tuple(c.data_ptr() for c in (*k_caches, *v_caches))
        if caches != self._caches:
            if not all(c.is_contiguous() for c in (*k_caches, *v_caches)):
                return None
            n = len(k_caches)
            for i in range(n):
                self.layers[i].k_cache, self.layers[i].v_cache = caches[i], caches[n + i]
            self._caches = caches
        h = h.contiguous()
        cos, sin = (c.reshape(t, d // 2).contiguous() for c in rope)
        slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
        slots = slots.contiguous()
        q_size, inter = self.heads * d, self.intermediate
        qkv_n = q_size + 2 * self.kv_heads * d
        # The step's scratch, [T, width] per buffer side by side, from the kept ones; x, returned, is its own.
        x = torch.empty(t * self.hidden, dtype=self.dtype)
        widths = (qkv_n, q_size, q_size, self.hidden, 2 * inter, inter, self.hidden)
        width = sum(widths)
        keep = _kept_rows(ctx.logits_rows, t)
        scratch = self._take_scratch(t, width)
        try:
            self._run(x, scratch[: t * width], widths, h, cos, sin, slots, plan, k_caches, ctx, keep)
        finally:
            self._give_back(scratch)
        if keep is None:
            return x.view(t, self.hidden).index_select(0, ctx.logits_indices)
        return x[: len(keep) * self.hidden].view(len(keep), self.hidden)

    # Spare buffers kept (the largest): a step and a short one the between_layers hook runs inside it.
    _KEPT = 2
    # A new buffer's rows, rounded up to a multiple of this: prompts a few tokens apart then share one (a buffer
    # only a step's exact size was replaced, mapped afresh, by most cold prompts of a run)
    _ROWS = 256

    def _take_scratch(self, rows: int, width: int) -> torch.Tensor:
        """A buffer of at least `rows` x `width` elements that no other running call holds. Why kept: a
        2,000-token prefill's scratch is ~60 MiB, which malloc maps fresh and unmaps after each step, so every
        step paid a page fault per 4 KiB on first write: ~15,000 of them, 0.1-0.2 s of a 1.2-1.4 s cold
        prefill on the 2-core Firecracker VM this was measured on (the default model, Q8 activations, float16
        KV). The kernels write every element they read, so a kept buffer's old contents never reach an
        output."""
        fits = [i for i, b in enumerate(self._spare) if b.numel() >= rows * width]
        if not fits:
            return torch.empty(-(-rows // self._ROWS) * self._ROWS * width, dtype=self.dtype)
        # (by index: list.remove compares tensors elementwise)
        return self._spare.pop(min(fits, key=lambda i: self._spare[i].numel()))

    def _give_back(self, scratch: torch.Tensor) -> None:
        self._spare.append(scratch)
        self._spare.sort(key=lambda b: b.numel(), reverse=True)
        del self._spare[self._KEPT :]

    def _run(
        self,
        x: torch.Tensor,
        scratch: torch.Tensor,
        widths: tuple[int, ...],
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        slots: torch.Tensor,
        plan: NativePlan,
        k_caches: Sequence[torch.Tensor],
        ctx: ForwardContext,
        keep: list[int] | None,
    ) -> None:
        t = h.shape[0]
        qkv, q, o, attn, gate_up, act, mlp = scratch.split([t * w for w in widths])
        a = _Args.from_buffer_copy(self.args)  # this call's own: a step run by the hook sets its own
        a.kv_dtype = DTYPE_CODES[k_caches[0].dtype]
        a.block_size = k_caches[0].shape[1]
        a.tokens = t
        a.h, a.x, a.cos, a.sin, a.slots = (
            h.data_ptr(),
            x.data_ptr(),
            cos.data_ptr(),
            sin.data_ptr(),
            slots.data_ptr(),
        )
        a.items, a.num_items = plan.items.data_ptr(), plan.items.shape[0]
        a.tables, a.table_width, a.causal = plan.tables.data_ptr(), plan.tables.shape[1], int(plan.is_causal)
        a.qkv, a.q, a.o, a.attn = qkv.data_ptr(), q.data_ptr(), o.data_ptr(), attn.data_ptr()
        a.gate_up, a.act, a.mlp = gate_up.data_ptr(), act.data_ptr(), mlp.data_ptr()
        a.threads = torch.get_num_threads()
        if keep is not None:
            rows = torch.tensor(keep, dtype=torch.int64)
            items = plan.for_rows(keep).items
            a.keep, a.num_keep = rows.data_ptr(), len(keep)
            a.keep_items, a.num_keep_items = items.data_ptr(), items.shape[0]
        num_layers = len(self.layers)
        hook = ctx.between_layers
        for first in range(num_layers) if hook is not None else (0,):
            if first and hook is not None:
                hook()
            a.first_layer, a.end_layer = first, first + 1 if hook is not None else num_layers
            rc = self.fn(ctypes.byref(a))
            if rc:
                where = (
                    f"layer {rc - 1}'s arguments"
                    if rc > 0
                    else f"the layer range [{first}, {a.end_layer}) or the kept rows"
                )
                raise RuntimeError(f"the native decoder stack refused {where}")


def _kept_rows(rows: Sequence[int] | None, tokens: int) -> list[int] | None:
    """`rows` where the last layer can run on them alone (strictly increasing, fewer than the step's
    `tokens`), else None: every row."""
    if rows is None or len(rows) >= tokens:
        return None
    kept = list(rows)
    if any(b <= a for a, b in zip(kept, kept[1:], strict=False)) or (
        kept and (kept[0] < 0 or kept[-1] >= tokens)
    ):
        return None
    return kept
