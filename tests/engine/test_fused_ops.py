"""The fused elementwise steps (engine/model/fused_ops.py, csrc/elementwise.cpp) against transformers' and
float64 references, and against themselves row by row (a row's bits must not depend on the batch or the
threads). Each failure names the CPU (isa_summary)."""

from __future__ import annotations

import pytest
import torch
from kernel_helpers import kernels_or_skip

from engine.model.kernels import fused_ops
from engine.model.kernels.invariance import isa_summary
from engine.model.layers.activation import silu
from engine.model.layers.norm import RMSNorm

DTYPES = [torch.float32, torch.bfloat16]


@pytest.fixture(autouse=True)
def _needs_kernels():
    kernels_or_skip("elementwise", "the native elementwise kernels (AVX512)")


def _norm(dtype: torch.dtype, n: int) -> RMSNorm:
    norm = RMSNorm(n, 1e-5)
    norm.weight.data = torch.randn(n)
    return norm.to(dtype)


def _one_step(ref: torch.Tensor) -> torch.Tensor:
    """One bfloat16 step at each value; in float32, 8 steps (2^-20): the sum of squares and exp round
    differently from torch's, and a rounding more or less propagates through the three products."""
    bits = 7 if ref.dtype == torch.bfloat16 else 20
    return ref.double().abs().clamp_min(2.0**-100) * 2.0**-bits


@pytest.mark.parametrize("n", [576, 40])  # 40: a last, partial vector
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_add_rms_norm_matches_transformers(dtype, n):
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    norm = _norm(dtype, n)
    theirs = LlamaRMSNorm(n, 1e-5).to(dtype)
    theirs.weight.data = norm.weight.data.clone()
    h, delta = torch.randn(9, n).to(dtype) * 3, torch.randn(9, n).to(dtype)
    total, out = fused_ops.add_rms_norm(h, delta, norm)
    want = theirs(h + delta)
    assert torch.equal(total, h + delta), isa_summary()
    assert out.dtype == dtype and ((out.double() - want.double()).abs() <= _one_step(want)).all(), (
        isa_summary()
    )
    alone = fused_ops.rms_norm(h + delta, norm)
    assert torch.equal(alone, out), isa_summary()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_silu_mul_matches_a_float64_reference(dtype):
    gate_up = (torch.randn(7, 2 * 200) * 4).to(dtype)
    got = fused_ops.silu_mul(gate_up, silu)
    g, up = gate_up.double().chunk(2, dim=-1)
    s = (g / (1 + torch.exp(-g))).to(dtype).double()  # the model rounds silu to its dtype, then multiplies
    want = (s * up).to(dtype)
    assert got.shape == (7, 200)
    assert ((got.double() - want.double()).abs() <= 2 * _one_step(want)).all(), isa_summary()


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_a_rows_bits_do_not_depend_on_the_batch_or_the_threads(dtype):
    norm = _norm(dtype, 576)
    h, delta, gate_up = (torch.randn(23, k).to(dtype) for k in (576, 576, 3072))

    def run() -> list[torch.Tensor]:
        return [*fused_ops.add_rms_norm(h, delta, norm), fused_ops.silu_mul(gate_up, silu)]

    batched = run()
    for i in range(23):
        row = [*fused_ops.add_rms_norm(h[i : i + 1], delta[i : i + 1], norm)]
        row.append(fused_ops.silu_mul(gate_up[i : i + 1], silu))
        for got, want in zip(row, batched, strict=True):
            assert torch.equal(got[0], want[i]), f"row {i}; {isa_summary()}"
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = run()
    finally:
        torch.set_num_threads(threads)
    for got, want in zip(single, batched, strict=True):
        assert torch.equal(got, want), isa_summary()


def test_other_dtypes_take_the_models_torch_path():
    norm = _norm(torch.float16, 64)
    h, delta = torch.randn(3, 64, dtype=torch.float16), torch.randn(3, 64, dtype=torch.float16)
    total, out = fused_ops.add_rms_norm(h, delta, norm)
    assert torch.equal(total, h + delta) and torch.equal(out, norm(h + delta))
    gate_up = torch.randn(3, 128, dtype=torch.float16)
    gate, up = gate_up.chunk(2, dim=-1)
    assert torch.equal(fused_ops.silu_mul(gate_up, silu), silu(gate) * up)


@pytest.mark.parametrize("dim", [64, 40])  # 40: a half of 20, a last partial vector
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rope_and_write_equals_the_models_torch_ops_bit_for_bit(dtype, dim):
    from engine.kv_store import write_slots
    from engine.model.layers.rotary import apply_rope

    t, h, hkv = 7, 9, 3
    qkv = torch.randn(t, (h + 2 * hkv) * dim).to(dtype)
    cos, sin = torch.randn(t, 1, dim // 2).to(dtype), torch.randn(t, 1, dim // 2).to(dtype)
    slots = torch.tensor([3, 17, 40, 41, 100, 5, 127])
    k_cache, v_cache = torch.zeros(8, 16, hkv, dim, dtype=dtype), torch.zeros(8, 16, hkv, dim, dtype=dtype)
    want_k, want_v = k_cache.clone(), v_cache.clone()
    q = fused_ops.rope_and_write(qkv, (cos, sin), slots, k_cache, v_cache, h)
    qk = apply_rope(qkv[:, : (h + hkv) * dim].view(t, h + hkv, dim), cos, sin)
    write_slots(want_k, want_v, qk[:, h:], qkv[:, (h + hkv) * dim :].view(t, hkv, dim), slots)
    assert q is not None
    assert torch.equal(q, qk[:, :h]) and torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v), (
        isa_summary()
    )


def test_rope_and_write_declines_what_it_does_not_run():
    t, h, hkv, d = 2, 2, 1, 8
    qkv = torch.randn(t, (h + 2 * hkv) * d, dtype=torch.float16)
    rope = (torch.ones(t, 1, d // 2, dtype=torch.float16), torch.zeros(t, 1, d // 2, dtype=torch.float16))
    caches = [torch.zeros(2, 16, hkv, d, dtype=torch.float16) for _ in range(2)]
    assert fused_ops.rope_and_write(qkv, rope, torch.tensor([0, 1]), *caches, h) is None
    wrong_width = torch.randn(t, (h + 2 * hkv) * d + 2)
    caches32 = [torch.zeros(2, 16, hkv, d) for _ in range(2)]
    rope32 = (torch.ones(t, 1, d // 2), torch.zeros(t, 1, d // 2))
    assert fused_ops.rope_and_write(wrong_width, rope32, torch.tensor([0, 1]), *caches32, h) is None
