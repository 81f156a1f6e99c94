"""The decoder's elementwise steps as one native call each on CPU (kernels/csrc/elementwise.cpp), torch elsewhere.

- `add_rms_norm(h, delta, norm)`: (h + delta, norm(h + delta)), the residual add fused with the next RMSNorm;
- `rms_norm(h, norm)`: norm(h);
- `silu_mul(gate_up)`: silu(gate) * up, for the fused gate/up projection's output;
- `rope_and_write(qkv, ...)`: RoPE on q and k and k, v written to their cache slots, for a backend that reads
  new keys from the cache (`reads_keys_from_cache`); None where it does not apply.

Why: a decode step ran ~1,600 torch ops, most of them these elementwise ones on a single row, and their
dispatch cost more than their arithmetic. The native path serves CPU tensors in float32 or bfloat16 where
the kernels load; CUDA, float16 and machines without the kernels take the torch path, which is the model's
original code. The kernel's header says where its last float32 bits differ from torch's (a fixed-order sum
of squares, its own exp) and why a row's bits still never depend on the batch.
"""

from __future__ import annotations

import torch

from engine.model.kernels.build import DTYPE_CODES, FLOAT32_BF16_CODES, Elementwise, kv_dtype_runs, load


def _native(x: torch.Tensor) -> Elementwise | None:  # None: the torch path
    if x.device.type != "cpu" or x.dtype not in FLOAT32_BF16_CODES:
        return None
    kernels, _ = load()
    return None if kernels is None else kernels.elementwise


def add_rms_norm(h: torch.Tensor, delta: torch.Tensor, norm) -> tuple[torch.Tensor, torch.Tensor]:
    """(h + delta, norm(h + delta)) for h, delta [T, hidden]; norm: an RMSNorm (weight, eps)."""
    kernels = _native(h)
    if kernels is None or delta.dtype != h.dtype or norm.weight.dtype != h.dtype:
        total = h + delta
        return total, norm(total)
    h, delta = h.contiguous(), delta.contiguous()
    total, out = torch.empty_like(h), torch.empty_like(h)
    _norm(kernels.add_rms_norm, h, delta, total, norm, out)
    return total, out


def rms_norm(h: torch.Tensor, norm) -> torch.Tensor:
    """norm(h) for h [T, hidden]."""
    kernels = _native(h)
    if kernels is None or norm.weight.dtype != h.dtype or h.dim() != 2:
        return norm(h)
    h = h.contiguous()
    out = torch.empty_like(h)
    _norm(kernels.add_rms_norm, h, None, None, norm, out)
    return out


def _norm(fn, h: torch.Tensor, delta, total, norm, out: torch.Tensor) -> None:
    rc = fn(
        FLOAT32_BF16_CODES[h.dtype],
        h.data_ptr(),
        None if delta is None else delta.data_ptr(),
        None if total is None else total.data_ptr(),
        norm.weight.data_ptr(),
        out.data_ptr(),
        h.shape[0],
        h.shape[1],
        norm.eps,
        torch.get_num_threads(),
    )
    if rc:
        raise RuntimeError(f"native RMSNorm refused its arguments (code {rc})")


def silu_mul(gate_up: torch.Tensor, torch_silu) -> torch.Tensor:
    """silu(gate) * up for gate_up [T, 2 I] (gate first); `torch_silu` is the model's own, for the torch path."""
    kernels = _native(gate_up)
    if kernels is None or gate_up.dim() != 2:
        gate, up = gate_up.chunk(2, dim=-1)
        return torch_silu(gate) * up
    gate_up = gate_up.contiguous()
    t, n = gate_up.shape[0], gate_up.shape[1] // 2
    out = gate_up.new_empty(t, n)
    rc = kernels.silu_mul(
        FLOAT32_BF16_CODES[gate_up.dtype], gate_up.data_ptr(), out.data_ptr(), t, n, torch.get_num_threads()
    )
    if rc:
        raise RuntimeError(f"native SiLU refused its arguments (code {rc})")
    return out


def rope_and_write(
    qkv: torch.Tensor,  # [T, (H + 2 Hkv) D]
    rope: tuple[torch.Tensor, torch.Tensor],  # cos, sin: [T, 1, D / 2] in the model dtype
    slot_mapping: torch.Tensor,  # [T]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    heads: int,
) -> torch.Tensor | None:
    """q after RoPE [T, H, D], with k (after RoPE) and v already in their cache slots; None where the native
    path does not apply (the caller then runs apply_rope and write_slots)."""
    kernels = _native(qkv)
    t, hkv, d = qkv.shape[0], k_cache.shape[2], k_cache.shape[3]
    cos, sin = rope
    if (
        kernels is None
        or not kv_dtype_runs(qkv.dtype, k_cache.dtype)
        or cos.dtype != qkv.dtype
        or not (k_cache.is_contiguous() and v_cache.is_contiguous())
        or qkv.stride(-1) != 1
        or qkv.shape[1] != (heads + 2 * hkv) * d
    ):
        return None
    cos, sin = cos.reshape(t, d // 2).contiguous(), sin.reshape(t, d // 2).contiguous()
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    q = qkv.new_empty(t, heads, d)
    rc = kernels.rope_write(
        FLOAT32_BF16_CODES[qkv.dtype],
        DTYPE_CODES[k_cache.dtype],
        qkv.data_ptr(),
        qkv.stride(0),
        cos.data_ptr(),
        sin.data_ptr(),
        slots.contiguous().data_ptr(),
        k_cache.data_ptr(),
        v_cache.data_ptr(),
        q.data_ptr(),
        t,
        heads,
        hkv,
        d,
        torch.get_num_threads(),
    )
    if rc:
        raise RuntimeError(f"native RoPE refused its arguments (code {rc})")
    return q
