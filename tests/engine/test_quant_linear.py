"""The GGUF-block linear kernel (engine/model/quant_linear.py, csrc/quant_linear.cpp).

References are independent of the kernel: gguf-py quantizes random weights and dequantizes them, and the
product is taken in float64. Invariance is Brine against itself: a row computed alone, at another place in a
batch, or with another thread count must keep its bits. Each failure names the CPU (isa_summary).
"""

from __future__ import annotations

import logging

import numpy as np
import pytest
import torch
from kernel_helpers import kernels_or_skip

from engine.model.kernels import build as native_kernels
from engine.model.kernels.invariance import isa_summary
from engine.model.layers.quant_linear import GGML_Q4_1, GGML_Q8_0, QuantLinear

TYPES = {"Q4_1": GGML_Q4_1, "Q8_0": GGML_Q8_0}


def _kernels() -> native_kernels.Kernels:
    return kernels_or_skip("quant_linear", "an AVX512-BF16 quantized kernel")


def _weights(kind: str, out_f: int, in_f: int, seed: int = 0) -> tuple[np.ndarray, torch.Tensor]:
    """(GGUF rows of random weights quantized by gguf-py, the same weights dequantized by gguf-py)."""
    from gguf import quants

    w = np.random.default_rng(seed).standard_normal((out_f, in_f)).astype(np.float32) * in_f**-0.5
    raw = quants.quantize(w, TYPES[kind])
    return raw, torch.from_numpy(quants.dequantize(raw, TYPES[kind]).astype(np.float32))


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("out_f,in_f", [(48, 64), (40, 96), (7, 32)])  # 40 and 7: a last, partial tile
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_matches_a_float64_product_with_the_dequantized_weights(kind, out_f, in_f, dtype):
    kernels = _kernels()
    raw, dense = _weights(kind, out_f, in_f)
    bias = torch.randn(out_f)
    layer = QuantLinear(kernels, TYPES[kind], raw, in_f, bias)
    x = torch.randn(11, in_f).to(dtype)
    got = layer(x)
    assert got.dtype == dtype and got.shape == (11, out_f)
    ref = x.double() @ dense.double().T + bias.double()
    if dtype == torch.float32:
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5, msg=isa_summary)
    else:  # the exact product rounded once to bfloat16: at most one bfloat16 step away
        step = ref.abs().clamp_min(2.0**-100) * 2.0**-7
        assert ((got.double() - ref).abs() <= step).all(), isa_summary()


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_rows_bits_do_not_depend_on_the_batch_its_place_or_the_threads(kind, dtype):
    kernels = _kernels()
    raw, _ = _weights(kind, 96, 128, seed=1)
    layer = QuantLinear(kernels, TYPES[kind], raw, 128)
    x = torch.randn(37, 128).to(dtype)  # 37: four groups of 8 rows and a group of 5
    batched = layer(x)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(37)])
    assert torch.equal(alone, batched), isa_summary()
    shifted = layer(torch.cat([torch.randn(3, 128).to(dtype), x]))[3:]  # every row in another group slot
    assert torch.equal(shifted, batched), isa_summary()
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        single = layer(x)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(single, batched), isa_summary()


@pytest.mark.parametrize("kind", TYPES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize("out_f", [40, 600])
def test_every_row_count_gives_each_row_its_bits_alone(kind, dtype, out_f):
    """The kernel groups rows (up to 12 or 16 a group, packed per group), reads records straight up to 48 rows
    and through per-thread panels of several tiles past that (panel_tiles: two, or up to 16 on AVX512's float32
    path): every count, in every path, gives each row the bits it has alone. 576 inputs: 18 blocks, past one
    16-block vector of block sums; 40 and 600 outputs: a partial tile, and 600 (38 tiles) more tiles a thread
    than one round of panels holds."""
    kernels = _kernels()
    raw, _ = _weights(kind, out_f, 576, seed=2)
    layer = QuantLinear(kernels, TYPES[kind], raw, 576, torch.randn(out_f))
    x = torch.randn(61, 576).to(dtype)
    alone = torch.cat([layer(x[i : i + 1]) for i in range(61)])
    for m in (2, 9, 13, 16, 17, 25, 33, 48, 49, 61):
        assert torch.equal(layer(x[:m]), alone[:m]), f"{m} rows; {isa_summary()}"


def test_a_layer_of_mixed_parts_is_its_parts_side_by_side():
    """A fused q/k/v whose parts have different types (a Q4_K_M file's Q6_K attn_v): each part's columns
    are that part run alone, bit for bit, and the whole matches the dequantized weights."""
    kernels = _kernels()
    (qk, dense_qk), (v, dense_v) = _weights("Q4_1", 48, 96, seed=4), _weights("Q8_0", 24, 96, seed=5)
    bias = torch.randn(72)
    layer = QuantLinear.of_parts(kernels, [(GGML_Q4_1, qk), (GGML_Q8_0, v)], 96, bias)
    assert layer.out_features == 72 and layer.kind == "Q4_1+Q8_0"
    x = torch.randn(9, 96)
    got = layer(x)
    assert torch.equal(got[:, :48], QuantLinear(kernels, GGML_Q4_1, qk, 96, bias[:48])(x))
    assert torch.equal(got[:, 48:], QuantLinear(kernels, GGML_Q8_0, v, 96, bias[48:])(x))
    ref = x.double() @ torch.cat([dense_qk, dense_v]).double().T + bias.double()
    torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5)


def test_refuses_what_it_cannot_run():
    kernels = _kernels()
    raw, _ = _weights("Q4_1", 16, 64)
    with pytest.raises(ValueError, match="multiple of 32"):
        QuantLinear(kernels, GGML_Q4_1, raw, 48)
    layer = QuantLinear(kernels, GGML_Q4_1, raw, 64)
    with pytest.raises(ValueError, match="float32 or bfloat16"):
        layer(torch.randn(2, 64, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"\[M, 64\]"):
        layer(torch.randn(2, 32))
    assert layer(torch.randn(0, 64)).shape == (0, 16)


def test_a_cpu_without_the_kernel_keeps_dense_weights(monkeypatch, caplog, tmp_path):
    """Where the kernel is missing the loader dequantizes, and says so, instead of failing."""
    from engine.model.loading import quantize as loader

    kernels = _kernels()
    without = native_kernels.Kernels(kernels.path, kernels.paged_attention, None)
    monkeypatch.setattr(loader, "load_kernels", lambda: (without, ""))
    source = tmp_path / "m.gguf"
    source.write_bytes(b"")
    (tmp_path / "complete").write_text(str(source))
    with caplog.at_level(logging.WARNING):
        assert loader.quantizable_gguf(tmp_path, torch.device("cpu"), torch.bfloat16) is None
    assert "dequantized" in caplog.text
    monkeypatch.setattr(loader, "load_kernels", lambda: (kernels, ""))
    assert loader.quantizable_gguf(tmp_path, torch.device("cpu"), torch.bfloat16) == source
    assert loader.quantizable_gguf(tmp_path, torch.device("cpu"), torch.float16) is None
    assert loader.quantizable_gguf(tmp_path / "nowhere", torch.device("cpu"), torch.bfloat16) is None


@pytest.mark.slow
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_default_model_runs_its_gguf_blocks_and_agrees_with_dequantized_weights(dtype):
    """Every linear of the default model runs as stored (Q4_1 layers, a Q8_0 head), and its logits agree
    with the same model on dequantized float32 weights: exactly the weights transformers reads."""
    from engine.errors import ModelNotFoundError
    from engine.model.loading.files import resolve_model
    from engine.model.loading.loader import load_model

    _kernels()
    try:
        path = resolve_model(None).path
    except ModelNotFoundError as exc:
        pytest.skip(f"default model not available here: {exc}")
    quant = load_model(path, torch.device("cpu"), dtype)
    kinds = [m.kind for m in quant.modules() if isinstance(m, QuantLinear)]
    assert kinds.count("Q4_1") == 4 * quant.cfg.num_layers
    assert isinstance(quant.lm_head, QuantLinear) and quant.lm_head.kind == "Q8_0"  # the tied head
    dense = load_model(path, torch.device("cpu"), torch.float32, quantized=False)
    x = dense.embed_tokens(torch.tensor([1, 504, 3458, 282, 4649, 314, 2385, 30]))  # any real activations
    for lq, ld in zip(quant.layers, dense.layers, strict=True):
        for name in ("self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"):
            q_mod, d_mod = lq.get_submodule(name), ld.get_submodule(name)
            inp = torch.randn(8, d_mod.in_features) if d_mod.in_features != x.shape[1] else x
            got, want = q_mod(inp.to(dtype)).double(), d_mod(inp).double()
            # float32: the same weights, another summation order; bfloat16: the input and the output rounded
            tol = 1e-4 if dtype == torch.float32 else 2.0**-6
            err = ((got - want).abs() / want.abs().max()).max().item()
            assert err <= tol, f"{name}: relative error {err}; {isa_summary()}"
