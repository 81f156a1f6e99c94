"""Numerics that a float32-only comparison cannot see: RMSNorm's float32 arithmetic under low-precision
inputs, every RoPE scaling's frequencies (linear, and llama3's smoothing band, which the shared fixture's
head_dim barely reaches), whole models with scaled RoPE against transformers, and bfloat16 on CPU against
transformers run in bfloat16 itself (not against a float32 reference, whose tolerance anything passes).
"""

from __future__ import annotations

import math
import random
from pathlib import Path

import pytest
import torch
import transformers
from tiny_config import TINY
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

from engine.model.config import parse_config
from engine.model.layers.norm import RMSNorm
from engine.model.layers.rotary import rope_inv_freq
from engine.model.loading.loader import load_model

CPU = torch.device("cpu")
# Llama 3.1's own RoPE settings: with head_dim 128, many frequencies fall inside the smoothing band.
LLAMA31_ROPE = dict(
    rope_type="llama3",
    rope_theta=500000.0,
    factor=8.0,
    low_freq_factor=1.0,
    high_freq_factor=4.0,
    original_max_position_embeddings=8192,
)
ROPES = {
    "default": dict(rope_type="default", rope_theta=10000.0),
    "linear": dict(rope_type="linear", rope_theta=10000.0, factor=4.0),
    "llama3": LLAMA31_ROPE,
}


def _hf_config(rope: dict, **extra) -> transformers.LlamaConfig:
    cfg = transformers.LlamaConfig(**{**TINY, **extra}, rope_parameters=dict(rope))
    cfg.architectures = ["LlamaForCausalLM"]  # as save_pretrained writes it
    return cfg


# ---- RMSNorm --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_rmsnorm_equals_transformers_bit_for_bit(dtype: torch.dtype) -> None:
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    gen = torch.Generator().manual_seed(0)
    # Large, uneven magnitudes: a mean of squares taken in bfloat16 visibly loses precision.
    x = (torch.randn(64, 512, generator=gen) * torch.logspace(-2, 2, 512)).to(dtype)
    weight = torch.randn(512, generator=gen).to(dtype)
    ours, ref = RMSNorm(512, 1e-5).to(dtype), LlamaRMSNorm(512, eps=1e-5).to(dtype)
    with torch.no_grad():
        ours.weight.copy_(weight)
        ref.weight.copy_(weight)
        assert torch.equal(ours(x), ref(x))
        # And what both compute: the float64 norm, rounded once to dtype before the weight (exactly so in
        # 16 bits, where float32 arithmetic leaves no trace; to float32's own precision in float32).
        x64 = x.double()
        exact = (x64 * torch.rsqrt(x64.pow(2).mean(-1, keepdim=True) + 1e-5)).to(dtype)
        if dtype == torch.float32:
            torch.testing.assert_close(ours(x), weight * exact, rtol=1e-5, atol=1e-7)
        else:
            assert torch.equal(ours(x), weight * exact)


# ---- RoPE frequencies -----------------------------------------------------------------------------------


@pytest.mark.parametrize("head_dim", [16, 64, 128])
@pytest.mark.parametrize("rope", list(ROPES))
def test_rope_inv_freq_equals_transformers(rope: str, head_dim: int) -> None:
    hf = _hf_config(ROPES[rope], head_dim=head_dim, max_position_embeddings=131072)
    ours = rope_inv_freq(parse_config(hf.to_dict()))
    ref, _ = ROPE_INIT_FUNCTIONS[rope](hf) if rope != "default" else (None, None)
    if ref is None:
        ref = 1.0 / (10000.0 ** (torch.arange(0, head_dim, 2).double() / head_dim))
    torch.testing.assert_close(ours.double(), ref.double(), rtol=1e-6, atol=0)


def test_the_llama3_check_reaches_the_smoothing_band() -> None:
    # Without frequencies strictly inside [old_len / high, old_len / low] a wrong smoothing formula passes.
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).double() / 128))
    wavelen = 2 * math.pi / inv
    band = (wavelen > 8192 / 4.0) & (wavelen < 8192 / 1.0)
    assert int(band.sum()) >= 3


# ---- whole models ---------------------------------------------------------------------------------------


def _tiny(tmp_path: Path, rope: dict) -> tuple[Path, torch.nn.Module]:
    cfg = _hf_config(rope)
    torch.manual_seed(1234)
    hf = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).eval()
    hf.save_pretrained(tmp_path, safe_serialization=True)
    return tmp_path, hf


def _prompt(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(128) for _ in range(n)]


def _ref_logits(hf: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return hf(torch.tensor([tokens])).logits[0].float()


# head_dim 16: with original_max_position_embeddings 64 the second frequency (wavelength ~32.5) lies in the
# smoothing band [16, 64], the first above it and the rest below, so all three llama3 branches run.
MODEL_ROPES = {
    "linear": ROPES["linear"],
    "llama3": {**LLAMA31_ROPE, "original_max_position_embeddings": 64},
}


@pytest.mark.parametrize("rope", list(MODEL_ROPES))
def test_scaled_rope_models_match_transformers_float32(rope: str, tmp_path: Path, paged) -> None:
    path, hf = _tiny(tmp_path, MODEL_ROPES[rope])
    model = load_model(path, CPU, torch.float32)
    run = paged(model)
    prompt = _prompt(70)  # positions well past the original 64, where the scalings differ most
    (ours,) = run.step([(prompt, 0, run.table_for(len(prompt)))])
    torch.testing.assert_close(ours, _ref_logits(hf, prompt), atol=2e-4, rtol=2e-4)


# Our bf16 logits against transformers' bf16 logits on these tiny models: 0.035 at most with the tiled,
# batch-invariant attention (bit-identical before it). Against a float32 reference a bf16 model differs by
# ~0.045 anyway, which is why that comparison caught nothing; in bf16 on both sides, rope_theta x1.05 moves the
# logits by 0.078, RMSNorm eps x100 by 0.078 and the attention scale x1.05 by 0.16. (RMSNorm computed in bf16,
# 0.047 here, is caught exactly by test_rmsnorm_equals_transformers_bit_for_bit.)
BF16_ATOL = 0.06


@pytest.mark.parametrize("rope", ["default", "llama3"])
def test_bfloat16_on_cpu_matches_transformers_in_bfloat16(rope: str, tmp_path: Path, paged) -> None:
    path, _ = _tiny(tmp_path, MODEL_ROPES.get(rope, ROPES["default"]))
    hf16 = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, attn_implementation="sdpa"
    ).eval()
    prompt = _prompt(40, 1)
    ref = _ref_logits(hf16, prompt)
    for pack in (True, False):
        run = paged(load_model(path, CPU, torch.bfloat16, pack=pack))
        (ours,) = run.step([(prompt, 0, run.table_for(len(prompt)))])
        torch.testing.assert_close(ours, ref, atol=BF16_ATOL, rtol=0)
