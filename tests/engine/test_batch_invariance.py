"""Batch size changes nothing, kernel by kernel: a linear layer's rows and the attention's rows come out with
the same bits whatever else is in the product, however it is padded, and however a prompt is chunked.

These compare Brine with itself on this machine, never with golden numbers, so they hold on every CPU; the
ISA is printed in the report header and in each failure message.
"""

from __future__ import annotations

import random

import pytest
import torch
from kernel_helpers import kernels_or_skip

from engine.model.attention.base import AttentionMetadata
from engine.model.attention.tiled import KV_TILE, TiledBackend, tree_sum
from engine.model.kernels.invariance import isa_summary
from engine.model.layers.activation import silu
from engine.model.layers.linear import PackedLinear, packing_supported, probe_row_rule

CPU = torch.device("cpu")
DTYPES = [torch.float32, torch.bfloat16]
# The default model's linear shapes (in, out): qkv, o, gate_up, down.
SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]


def _dtype_ok(dtype: torch.dtype) -> None:
    if not packing_supported(CPU, dtype):
        pytest.skip(f"no packed oneDNN {dtype} linears here ({isa_summary()})")


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
def test_a_linear_rows_bits_do_not_depend_on_the_row_count(shape, dtype):
    _dtype_ok(dtype)
    in_f, out_f = shape
    g = torch.Generator().manual_seed(1)
    weight = (torch.randn(out_f, in_f, generator=g) * in_f**-0.5).to(dtype)
    bias = torch.randn(out_f, generator=g).to(dtype)
    layer = PackedLinear(weight, bias, probe_row_rule(in_f, out_f, dtype, 300))
    x = torch.randn(700, in_f, generator=g).to(dtype)
    with torch.inference_mode():
        ref = layer(x)
        rng = random.Random(0)
        # Row counts the probe never tried, at random offsets: every row keeps its bits.
        for m in [1, 2, 3, 5, 7, 13, 41, 97, 301, 333, 650] + [rng.randrange(1, 690) for _ in range(6)]:
            start = rng.randrange(0, 700 - m)
            got = layer(x[start : start + m])
            assert torch.equal(got, ref[start : start + m]), (
                f"{m} rows at offset {start} differ from the same rows in 700 ({isa_summary()}, "
                f"rows fed as {layer.rows})"
            )


def test_silu_is_the_same_at_every_position():
    x = torch.randn(4099) * 4
    whole = silu(x)
    assert torch.equal(torch.cat([silu(x[i : i + 7]) for i in range(0, 4099, 7)]), whole)
    assert torch.allclose(whole, torch.nn.functional.silu(x), rtol=1e-6, atol=1e-7)


def test_tree_sum_ignores_trailing_zeros_and_matches_a_plain_sum():
    x = torch.randn(2, 13, 5, dtype=torch.float64)
    padded = torch.cat([x, torch.zeros(2, 19, 5, dtype=torch.float64)], dim=1)
    assert torch.equal(tree_sum(x, 1), tree_sum(padded, 1))
    assert torch.allclose(tree_sum(x, 1), x.sum(1))


class _Cache:
    """A random paged KV cache with shuffled block tables, and a driver for the tiled backend."""

    def __init__(self, dtype, window=None, heads=(6, 2), dim=32, bs=16, device=CPU, backend=None):
        self.h, self.hkv = heads
        self.d, self.bs, self.window, self.dtype, self.device = dim, bs, window, dtype, device
        g = torch.Generator().manual_seed(3)
        self.k = torch.randn(128, bs, self.hkv, dim, generator=g).to(device, dtype)
        self.v = torch.randn(128, bs, self.hkv, dim, generator=g).to(device, dtype)
        blocks = list(range(1, 128))
        random.Random(4).shuffle(blocks)
        self.free = blocks
        self.backend = backend or TiledBackend(device, dim)

    def table(self, n: int) -> list[int]:
        out, self.free = self.free[: -(-n // self.bs)], self.free[-(-n // self.bs) :]
        return out

    def queries(self, seq: int, length: int) -> torch.Tensor:
        """The queries of sequence `seq` at positions 0..length-1: a pure function of (seq, position)."""
        g = torch.Generator().manual_seed(100 + seq)
        return torch.randn(length, self.h, self.d, generator=g).to(self.device, self.dtype)

    def run(self, reqs: list[tuple[int, int, int, list[int]]]) -> list[torch.Tensor]:
        """reqs: (seq, first query position, query count, table) -> each request's attention output."""
        q = torch.cat([self.queries(s, a + n)[a:] for s, a, n, _ in reqs])
        meta = AttentionMetadata(
            query_lens=[n for _, _, n, _ in reqs],
            context_lens=[a + n for _, a, n, _ in reqs],
            block_tables=[t for *_, t in reqs],
            block_size=self.bs,
            slot_mapping=torch.zeros(0, dtype=torch.int64, device=self.device),
        )
        plan = self.backend.plan(meta)
        with torch.inference_mode():
            out = self.backend.forward(q, q, q, self.k, self.v, plan, self.window, self.d**-0.5)
        return list(out.split(meta.query_lens))


def _cpu_backend(name: str, dim: int):
    if name == "tiled":
        return TiledBackend(CPU, dim)
    from engine.model.attention.native import NativeBackend

    return NativeBackend(kernels_or_skip())


# dim 32: the native kernel's generic build (any block size and head_dim); dim 64 with block size 16: its
# specialised one (the default model's shape).
@pytest.mark.parametrize("dim", [32, 64])
@pytest.mark.parametrize("backend", ["tiled", "native"])
@pytest.mark.parametrize("window", [None, 40], ids=["causal", "window40"])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_attention_rows_are_the_same_alone_chunked_batched_and_padded(dtype, window, backend, dim):
    _check_attention_invariance(_Cache(dtype, window, dim=dim, backend=_cpu_backend(backend, dim)))


@pytest.mark.cuda
@pytest.mark.parametrize("window", [None, 40], ids=["causal", "window40"])
def test_flex_attention_on_cuda_is_batch_invariant(window):
    """The CUDA path (FlexAttention, compiled by Triton): same property, fixed tiles, no split-KV."""
    from engine.model.attention.flex import FlexBackend

    cuda = torch.device("cuda")
    flex = FlexBackend(cuda, 128, 16, max_rows=2048, compile=True)
    c = _Cache(torch.bfloat16, window, dim=64, device=cuda, backend=flex)
    _check_attention_invariance(c)
    assert flex.failed is None and flex.succeeded


def _check_attention_invariance(c: _Cache) -> None:
    length = 300  # several key tiles, a partial last one
    table = c.table(length)
    alone = torch.cat(c.run([(0, 0, length, table)]))  # a fresh prefill of the whole prompt
    # Chunked as after a prefix hit or under a small token budget, at block-unaligned cuts.
    for cuts in ([0, 17, 64, 200, 300], [0, 255, 256, 300], [0, 1, 2, 299, 300]):
        parts = [c.run([(0, a, b - a, table)])[0] for a, b in zip(cuts, cuts[1:], strict=False)]
        assert torch.equal(torch.cat(parts), alone), f"chunks {cuts} ({isa_summary()})"
    # Decodes one at a time, alone and grouped with longer and shorter contexts (padding to their tiles).
    others = [(s, n, c.table(n)) for s, n in ((1, 700), (2, 9), (3, 130))]
    for pos in (0, 63, 64, 150, 299):
        solo = c.run([(0, pos, 1, table)])[0]
        assert torch.equal(solo[0], alone[pos])
        decodes = [(s, n - 1, 1, t) for s, n, t in others[:2]]
        batch = c.run([*decodes, (0, pos, 1, table), (3, 5, 40, others[2][2])])
        assert torch.equal(batch[2][0], alone[pos]), f"decode at {pos} in a batch ({isa_summary()})"
    # A prefill chunk batched with decodes and another prefill.
    mixed = c.run([(1, 699, 1, others[0][2]), (0, 100, 150, table), (2, 0, 9, others[1][2])])
    assert torch.equal(mixed[1], alone[100:250])


@pytest.mark.parametrize("backend", ["tiled", "native"])
def test_attention_matches_a_float64_softmax(backend):
    c = _Cache(torch.float32, backend=_cpu_backend(backend, 32))
    table = c.table(130)
    out = c.run([(0, 0, 130, table)])[0].double()
    q = c.queries(0, 130).double()
    k = c.k[table].reshape(-1, c.hkv, c.d)[:130].double().repeat_interleave(c.h // c.hkv, dim=1)
    v = c.v[table].reshape(-1, c.hkv, c.d)[:130].double().repeat_interleave(c.h // c.hkv, dim=1)
    s = torch.einsum("qhd,khd->hqk", q, k) * c.d**-0.5
    s = s.masked_fill(torch.ones(130, 130, dtype=torch.bool).triu(1), -torch.inf)
    ref = torch.einsum("hqk,khd->qhd", s.softmax(-1), v)
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
    assert KV_TILE < 130  # the comparison spans more than one key tile


@pytest.mark.slow
@pytest.mark.usefixtures("fresh_dynamo")  # compiled anew, whatever compiled before (conftest.fresh_dynamo)
def test_flex_attention_logic_is_batch_invariant_compiled_on_cpu():
    """The CUDA path's planning (one flex call for every request, every block masked-partial in logical
    order), compiled by inductor for CPU, where this suite can run it: batch-invariant as on CUDA."""
    from engine.model.attention.flex import FlexBackend

    flex = FlexBackend(CPU, 128, 16, max_rows=2048, compile=True)
    _check_attention_invariance(_Cache(torch.float32, dim=64, backend=flex))
    assert flex.failed is None and flex.succeeded
