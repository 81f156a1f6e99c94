"""Q8 activations (csrc/quant_q8.h, `--quantize-activations q8`): every GGUF type, on every tier this CPU runs.

The kernel quantizes each row's blocks of 32 inputs to int8 and takes exact integer dot products, so its
output is the float64 product of the *quantized* x with gguf's dequantized weights, up to float32 rounding of
the per-block scaling; a row's bits do not depend on the batch, the row count or the threads; and the AVX512,
AVX2 and portable builds (and this CPU's own) give the same bits, bfloat16 activations included.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from kernel_helpers import assert_rows_keep_their_bits, kernels_or_skip
from test_kernel_tiers import _gguf_weights, _tier

from engine.model.kernels import build as native_kernels
from engine.model.kernels.invariance import isa_summary
from engine.model.layers.quant_linear import TYPE_NAMES, QuantLinear


@pytest.fixture(scope="module", params=list(native_kernels.TIERS))
def tier(request) -> native_kernels.Kernels:
    return _tier(request.param)


def q8(x: torch.Tensor) -> torch.Tensor:
    """x as the kernel quantizes it, dequantized in float64: per block of 32, in float32, d = amax / 127 and
    q = round-half-even(x * (127 / amax))."""
    b = x.float().numpy().reshape(x.shape[0], -1, 32)
    amax = np.abs(b).max(axis=-1, keepdims=True)
    safe = np.where(amax > 0, amax, np.float32(1))
    q = np.rint(b * (np.float32(127) / safe)).astype(np.float32)
    d = (amax / np.float32(127)).astype(np.float32)
    assert np.abs(q).max() <= 127
    return torch.from_numpy((q.astype(np.float64) * d.astype(np.float64)).reshape(x.shape))


@pytest.mark.parametrize("ggml_type", list(TYPE_NAMES), ids=TYPE_NAMES.get)
def test_every_gguf_type_is_the_product_of_the_quantized_rows_and_keeps_a_rows_bits(
    tier, tmp_path, ggml_type
):
    out_f, in_f = 40, 512  # a last, partial tile; two K-quant super-blocks
    raw, dense = _gguf_weights(tmp_path, ggml_type, out_f, in_f, seed=ggml_type)
    gen = torch.Generator().manual_seed(100 + ggml_type)
    bias = torch.randn(out_f, generator=gen)
    layer = QuantLinear(tier, ggml_type, raw, in_f, bias, q8_activations=True)
    native = QuantLinear(kernels_or_skip("quant_linear"), ggml_type, raw, in_f, bias, q8_activations=True)
    assert layer.kind.endswith(" x Q8")
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(57, in_f, generator=gen).to(dtype)
        x[3, 64:96] = 0  # a block of zeros: d = 0, its products vanish
        got = layer(x)
        ref = q8(x) @ dense.T + bias.double()
        what = f"{TYPE_NAMES[ggml_type]} {dtype} on {tier.tier} ({isa_summary()})"
        # exact integer sums; the float32 steps per block (d dx, then an fma into the total) and the bias
        scale = (q8(x).abs() @ dense.abs().T + bias.double().abs()) * 2.0**-20
        if dtype == torch.bfloat16:
            scale = scale + ref.abs() * 2.0**-8  # the output rounded to bfloat16
        assert ((got.double() - ref).abs() <= scale).all(), what
        # and far from the float path's rounding of x: the test would catch Q8 not being applied
        assert not torch.equal(got, QuantLinear(tier, ggml_type, raw, in_f, bias)(x)), what
        assert_rows_keep_their_bits(layer, x, got, what)
        assert torch.equal(native(x), got), f"{what}: differs from this CPU's own build"


def test_rows_past_one_chunk_are_each_the_product_of_their_own_quantized_x(tier, tmp_path):
    """Past 512 KB of Q8 rows, run_q8 takes the rows chunk by chunk (each over all the thread's tiles): at 4,096
    inputs a chunk is ~100 rows, so 301 rows are four chunks, the last a partial one. Every row must be the
    product of its quantized x, whichever chunk holds it, and keep the bits it has alone or in a short batch."""
    from gguf import GGMLQuantizationType as T

    out_f, in_f = 40, 4096
    raw, dense = _gguf_weights(tmp_path, int(T.Q4_1), out_f, in_f, seed=7)
    layer = QuantLinear(tier, int(T.Q4_1), raw, in_f, q8_activations=True)
    x = torch.randn(301, in_f, generator=torch.Generator().manual_seed(8))
    got = layer(x)
    ref = q8(x) @ dense.T
    scale = (q8(x).abs() @ dense.abs().T) * 2.0**-20
    what = f"{tier.tier} ({isa_summary()})"
    assert ((got.double() - ref).abs() <= scale).all(), what
    assert_rows_keep_their_bits(layer, x, got, what)


def test_a_row_with_a_nan_or_an_infinity_comes_out_nan_and_leaves_the_others():
    from gguf import quants

    kernels = kernels_or_skip("quant_linear")
    raw = quants.quantize(np.random.default_rng(1).standard_normal((20, 64)).astype(np.float32), 3)
    layer = QuantLinear(kernels, 3, raw, 64, q8_activations=True)
    x = torch.randn(3, 64)
    clean = layer(x)
    x[1, 5], x[2, 40] = float("nan"), float("inf")
    got = layer(x)
    assert torch.equal(got[0], clean[0])
    assert got[1:].isnan().all()


def _default_model_path():
    from engine.model.loading.files import ModelNotFoundError, resolve_model

    try:
        return resolve_model(None).path
    except ModelNotFoundError as exc:
        pytest.skip(f"default model not available here: {exc}")


def test_the_default_models_layers_and_head_take_q8(tiny_model):
    from engine.model.loading.loader import load_model

    kernels_or_skip("quant_linear")
    model = load_model(_default_model_path(), torch.device("cpu"), torch.float32, quantize_activations="q8")
    kinds = [m.kind for m in model.modules() if isinstance(m, QuantLinear)]
    assert kinds.count("Q4_1 x Q8") == 120 and kinds.count("Q8_0 x Q8") == 1 and len(kinds) == 121, kinds
    with pytest.raises(
        ValueError, match="--quantize-activations q8"
    ):  # Hugging Face weights: nothing to apply to
        load_model(tiny_model("llama").path, torch.device("cpu"), torch.float32, quantize_activations="q8")


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_default_model_with_q8_activations_answers_as_if_alone(dtype, monkeypatch):
    """The invariance property test's check with --quantize-activations q8: three requests sharing a 32-token
    prefix (one seeded), prefix caching, 16-token steps that chunk every prompt, a pool that forces
    preemption; each answers with the tokens and logprobs it gets alone on a cold engine."""
    import test_invariance_property as prop

    from engine.async_engine import AsyncEngine
    from engine.config import EngineConfig

    kernels_or_skip("quant_linear")
    _default_model_path()

    def q8_engine(dtype: str, **kw) -> AsyncEngine:
        return AsyncEngine.from_config(
            EngineConfig(device="cpu", dtype=dtype, quantize_activations="q8", **kw)
        )

    monkeypatch.setattr(prop, "engine", q8_engine)
    prop.check_small_workload(dtype, seed=12, caching=True)


@pytest.mark.parametrize("name", [*native_kernels.TIERS, "native"])
def test_auto_turns_q8_on_on_the_tiers_it_was_measured_faster_on(name, monkeypatch):
    from engine.model import device
    from engine.model.loading.loader import Q8_AUTO_TIERS, load_model

    path = _default_model_path()
    if name != "native":
        _tier(name)
        monkeypatch.setenv("BRINE_CPU_TIER", name)
    for cached in (native_kernels.load, device.cpu_has_native_bf16):
        cached.cache_clear()
    try:
        kernels, _ = native_kernels.load()
        if kernels is None:
            pytest.skip("no kernels here")
        model = load_model(path, torch.device("cpu"), torch.float32, quantize_activations="auto")
        kinds = {m.kind for m in model.modules() if isinstance(m, QuantLinear)}
        want = {"Q4_1 x Q8", "Q8_0 x Q8"} if kernels.tier in Q8_AUTO_TIERS else {"Q4_1", "Q8_0"}
        assert kinds == want, f"{kernels.tier}: {kinds}"
        assert (
            ("avx2" in Q8_AUTO_TIERS)
            and "portable" not in Q8_AUTO_TIERS
            and "avx512-bf16" not in Q8_AUTO_TIERS
        )
    finally:
        monkeypatch.delenv("BRINE_CPU_TIER", raising=False)
        for cached in (native_kernels.load, device.cpu_has_native_bf16):
            cached.cache_clear()
