"""CPU linears on pre-packed oneDNN weights (bfloat16 and float32): the logits of the plain `F.linear` model up
to rounding, each layer padding its rows as this machine's probe says, and the probe itself."""

from __future__ import annotations

import logging
import random
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from engine.model.kernels import invariance
from engine.model.kernels.invariance import RowRule, row_multiple, row_rule
from engine.model.layers.linear import PackedLinear, packing_supported
from engine.model.loading.loader import load_model

CPU = torch.device("cpu")
needs_packing = pytest.mark.skipif(
    not packing_supported(CPU, torch.bfloat16), reason="this torch/CPU cannot run packed bfloat16 linears"
)
# Packed and plain kernels accumulate in different orders: bfloat16 logits of the tiny models differ by a
# few bfloat16 ulps of the activations, float32 ones by float32 rounding.
TOLERANCE = {torch.bfloat16: 0.1, torch.float32: 1e-4}


def _steps(paged, model) -> list[torch.Tensor]:
    """Two prompts of different lengths, then three batched decode steps; every step's logits."""
    run = paged(model, seed=7)  # same seed: both models get the same non-contiguous block tables
    rng = random.Random(3)
    prompts = [[rng.randrange(128) for _ in range(n)] for n in (13, 6)]
    tables = [run.table_for(n + 3) for n in (13, 6)]
    logits = run.step([(p, 0, t) for p, t in zip(prompts, tables, strict=True)])
    out = [torch.cat(logits)]
    seqs = [p + [int(lg[-1].argmax())] for p, lg in zip(prompts, logits, strict=True)]
    for _ in range(3):
        logits = run.step([(s[-1:], len(s) - 1, t) for s, t in zip(seqs, tables, strict=True)])
        out.append(torch.cat(logits))
        for s, lg in zip(seqs, logits, strict=True):
            s.append(int(lg[-1].argmax()))
    return out


def _with_random_biases(src: Path, dest: Path) -> Path:
    """A copy of a tiny checkpoint whose biases are not zero (transformers initialises them to zero, which
    would hide a packed layer that drops its bias)."""
    shutil.copytree(src, dest)
    tensors = load_file(dest / "model.safetensors")
    gen = torch.Generator().manual_seed(5)
    for name, t in tensors.items():
        if name.endswith(".bias"):
            tensors[name] = torch.randn(t.shape, generator=gen, dtype=t.dtype)
    save_file(tensors, dest / "model.safetensors")
    return dest


@needs_packing
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=str)
def test_packed_model_matches_unpacked(arch, tiny_model, paged, tmp_path, dtype):
    path = _with_random_biases(tiny_model(arch).path, tmp_path / arch)
    plain = load_model(path, CPU, dtype, pack=False)
    packed = load_model(path, CPU, dtype)
    assert not any(isinstance(m, nn.Linear) for m in packed.modules())
    # qkv, o, gate_up, down per layer, and the head (its own, or a packed copy of a tied embedding)
    assert sum(isinstance(m, PackedLinear) for m in packed.modules()) == 4 * packed.cfg.num_layers + 1
    assert isinstance(packed.lm_head, PackedLinear)  # tied heads get a packed copy of the embedding
    for a, b in zip(_steps(paged, plain), _steps(paged, packed), strict=True):
        assert torch.allclose(a, b, atol=TOLERANCE[dtype], rtol=0), (a - b).abs().max()


def test_float16_and_non_cpu_are_not_packed(tiny_model):
    assert packing_supported(CPU, torch.float32) == torch.backends.mkldnn.is_available()
    assert not packing_supported(CPU, torch.float16)
    assert not packing_supported(torch.device("cuda"), torch.bfloat16)
    model = load_model(tiny_model("qwen2").path, CPU, torch.float16, batch_invariant=False)
    assert not any(isinstance(m, PackedLinear) for m in model.modules())
    assert not isinstance(model.lm_head, PackedLinear)


def test_a_dtype_whose_linears_cannot_be_invariant_is_a_startup_error(tiny_model):
    """float16 linears run as plain torch matmuls on CPU: with batch invariance on, loading refuses them
    with a message that says what to do, instead of serving answers that depend on the batch."""
    with pytest.raises(invariance.NotInvariantError, match="--dtype float32"):
        load_model(tiny_model("qwen2").path, CPU, torch.float16)


def test_the_probe_finds_the_row_multiple_a_kernel_needs():
    rows = torch.randn(320, 8)

    def pads_to_four(x: torch.Tensor) -> torch.Tensor:  # rounds differently unless M is a multiple of 4
        return x * 3 if x.shape[0] % 4 == 0 else x * 3 + 1e-3

    assert row_multiple(lambda x: x * 3, rows, "exact") == 1
    assert row_multiple(pads_to_four, rows, "needs 4") == 4


def test_where_no_multiple_helps_the_probe_caps_the_rows_per_call():
    """oneDNN's AMX bfloat16 linear with K = 1,536 sums K in another order for a band of row counts (150-256
    at two threads): no padding multiple avoids every such count, a cap of 128 rows a call does. The probe
    finds the cap, with the padding odd counts need on top; calls under the rule keep every row's bits."""
    rows = torch.randn(400, 8)

    def banded(x: torch.Tensor) -> torch.Tensor:
        m = x.shape[0]
        return x * 3 + (1e-3 if 150 <= m <= 256 or m % 2 else 0.0)

    assert row_multiple(lambda x: x * 3 + (1e-3 if 150 <= x.shape[0] <= 256 else 0.0), rows, "band") == 16
    rule = row_rule(banded, rows, "band and odd")
    assert rule == RowRule(2, 128)
    ref = rule.apply(banded, rows)
    assert torch.equal(ref, rows * 3)
    for start, m in [(0, 1), (3, 151), (7, 255), (1, 129), (0, 399)]:
        assert torch.equal(rule.apply(banded, rows[start : start + m]), ref[start : start + m])


def test_a_row_rule_needs_a_cap_its_multiple_divides():
    with pytest.raises(ValueError, match="multiple"):
        RowRule(16, 24)
    assert RowRule(2, 128).and_(RowRule(4)) == RowRule(4, 128)
    assert RowRule(1).and_(RowRule(1, 64)).and_(RowRule(2, 128)) == RowRule(2, 64)


def test_the_probe_sees_a_summation_order_through_bfloat16_rounding():
    """A bfloat16 kernel whose one-row products sum K in another float32 order (what an Ice Lake's emulated
    bfloat16 linear does): with cancelling pairs in the probe's inputs, the one-row products differ, and
    the probe asks for padding to 2."""
    g = torch.Generator().manual_seed(0)
    weight, rows = invariance.sensitize(
        torch.randn(64, 256, generator=g) / 16, torch.randn(80, 256, generator=g)
    )
    w = weight.to(torch.bfloat16).float()
    perm = torch.randperm(256, generator=g)

    def kernel(x: torch.Tensor) -> torch.Tensor:  # one row: a float32 sum in another order; else ~exact
        if x.shape[0] == 1:
            products = x.float()[0, perm] * w[:, perm]  # [out, in], exact; summed in float32, in order
            total = torch.zeros(w.shape[0])
            for i in range(products.shape[1]):
                total += products[:, i]
            return total.to(torch.bfloat16)[None]
        return (x.double() @ w.double().T).to(torch.bfloat16)

    assert row_multiple(kernel, rows.to(torch.bfloat16), "reorders one row") == 2


def test_the_probe_warns_where_no_padding_helps(caplog):
    with caplog.at_level(logging.WARNING, logger=invariance.__name__):
        got = row_multiple(lambda x: x * x.shape[0], torch.randn(320, 8), "depends on M")
    assert got == invariance.ROW_MULTIPLES[-1]
    assert "not guaranteed" in caplog.text and "cpu_capability" in caplog.text


@pytest.mark.slow
@needs_packing
def test_default_model_packed_logits_match_unpacked(paged):
    from engine.errors import ModelNotFoundError
    from engine.model.loading.files import resolve_model

    try:
        path = resolve_model(None).path
    except ModelNotFoundError as exc:
        pytest.skip(f"default model not available here: {exc}")
    # quantized=False: this compares packing against plain bfloat16, not the GGUF blocks (test_quant_linear).
    # Both against float32: packed bfloat16 accumulates in another order than plain bfloat16, or (a CPU
    # without native bfloat16) in float32, rounded once; either way its logits are as close to float32's as
    # the plain ones, and a dropped bias or a misplaced weight would not be. (The prompts' logits only: a
    # greedy continuation may differ between dtypes.)
    plain, packed, exact = (
        load_model(path, CPU, dtype, pack=pack, quantized=False)
        for dtype, pack in ((torch.bfloat16, False), (torch.bfloat16, True), (torch.float32, False))
    )
    ref = _steps(paged, exact)[0]
    plain_err = (_steps(paged, plain)[0].float() - ref).abs().max().item()
    packed_err = (_steps(paged, packed)[0].float() - ref).abs().max().item()
    assert packed_err <= max(plain_err, 0.5) + 0.25, (packed_err, plain_err)
