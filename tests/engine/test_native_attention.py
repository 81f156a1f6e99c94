"""Brine's C++ paged attention (engine/model/native_attention.py): right answers on every shape it takes, the
same bits whatever shares its call or however many threads run it, and a clean fallback where it cannot build.

Batch invariance over chunking, batching and padding is checked with the tiled backend's own test
(test_batch_invariance.py, parametrised over both). Results are compared with float64 references computed
here, never with golden numbers; the ISA is in each failure message.
"""

from __future__ import annotations

import random

import pytest
import torch
from kernel_helpers import kernels_or_skip

from engine.model.attention.base import AttentionMetadata
from engine.model.kernels.invariance import isa_summary

CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def native():
    from engine.model.attention.native import NativeBackend

    return NativeBackend(kernels_or_skip())


class Paged:
    """A random paged cache (blocks handed out in shuffled order) and a float64 reference over it."""

    def __init__(self, heads=(6, 2), dim=64, bs=16, dtype=torch.float32, blocks=160, seed=0):
        self.h, self.hkv, self.d, self.bs, self.dtype = heads[0], heads[1], dim, bs, dtype
        g = torch.Generator().manual_seed(seed)
        self.k = torch.randn(blocks, bs, self.hkv, dim, generator=g).to(dtype)
        self.v = torch.randn(blocks, bs, self.hkv, dim, generator=g).to(dtype)
        self.free = list(range(1, blocks))
        random.Random(seed).shuffle(self.free)
        self.g = g

    def table(self, n: int) -> list[int]:
        need = -(-n // self.bs)
        out, self.free = self.free[:need], self.free[need:]
        return out

    def meta(self, reqs, causal=True) -> AttentionMetadata:
        """reqs: (query count, context length, table)."""
        return AttentionMetadata(
            query_lens=[n for n, _, _ in reqs],
            context_lens=[c for _, c, _ in reqs],
            block_tables=[t for *_, t in reqs],
            block_size=self.bs,
            slot_mapping=torch.zeros(0, dtype=torch.int64),
            is_causal=causal,
        )

    def reference(self, q, reqs, window, causal=True) -> torch.Tensor:
        out, start = [], 0
        for n, ctx, table in reqs:
            k = self.k[table].reshape(-1, self.hkv, self.d)[:ctx].double()
            v = self.v[table].reshape(-1, self.hkv, self.d)[:ctx].double()
            rep = self.h // self.hkv
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            qq = q[start : start + n].double()
            s = torch.einsum("qhd,khd->hqk", qq, k) * self.d**-0.5
            qpos = torch.arange(ctx - n, ctx)[:, None]
            kpos = torch.arange(ctx)[None, :]
            hidden = (kpos > qpos) if causal else torch.zeros(n, ctx, dtype=torch.bool)
            if window is not None:
                hidden = hidden | (kpos <= qpos - window)
            s = s.masked_fill(hidden, -torch.inf)
            out.append(torch.einsum("hqk,khd->qhd", s.softmax(-1), v))
            start += n
        return torch.cat(out)


def _run(backend, c: Paged, q, reqs, window, causal=True):
    meta = c.meta(reqs, causal)
    with torch.inference_mode():
        return backend.forward(q, q, q, c.k, c.v, backend.plan(meta), window, c.d**-0.5)


def _on_one_and_more_threads(
    backend, c: Paged, q, reqs, window=None, more: int | None = None
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """_run on 1 thread, then on `more` (default: torch's count, at least 2): (one, more's, that count)."""
    before = torch.get_num_threads()
    count = more or max(2, before)
    try:
        torch.set_num_threads(1)
        one = _run(backend, c, q, reqs, window)
        torch.set_num_threads(count)
        many = _run(backend, c, q, reqs, window)
    finally:
        torch.set_num_threads(before)
    return one, many, count


TOL = {torch.float32: 2e-5, torch.bfloat16: 2e-2, torch.float16: 4e-3}


@pytest.mark.parametrize(
    "heads,dim,bs",
    [
        ((6, 2), 64, 16),
        ((9, 3), 64, 16),
        ((4, 4), 128, 16),
        ((6, 2), 80, 16),
        ((6, 1), 32, 8),
        ((6, 2), 64, 32),
    ],
    ids=["gqa3-d64", "smollm-shape", "mha-d128", "d80-generic", "mqa-bs8", "bs32-generic"],
)
@pytest.mark.parametrize("window", [None, 37], ids=["full", "window37"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_a_mixed_batch_matches_a_float64_reference(native, heads, dim, bs, window, dtype):
    c = Paged(heads, dim, bs, dtype)
    # A fresh prefill, a chunk after a cached prefix, decodes at block-aligned and unaligned contexts.
    reqs = [(n, ctx, c.table(ctx)) for n, ctx in ((70, 70), (21, 150), (1, 1), (1, 64), (1, 333), (5, 96))]
    q = torch.randn(sum(n for n, _, _ in reqs), c.h, dim, generator=c.g).to(dtype)
    got = _run(native, c, q, reqs, window)
    ref = c.reference(q, reqs, window)
    err = (got.double() - ref).abs().max().item()
    assert err <= TOL[dtype], f"max error {err} ({isa_summary()})"


def test_non_causal_attention_sees_the_whole_context(native):
    c = Paged()
    reqs = [(9, 40, c.table(40)), (1, 17, c.table(17))]
    q = torch.randn(10, c.h, c.d, generator=c.g)
    got = _run(native, c, q, reqs, None, causal=False)
    assert (got.double() - c.reference(q, reqs, None, causal=False)).abs().max() <= 2e-5


def test_strided_queries_are_read_in_place(native):
    """The model hands q as a slice of the fused q/k projection (rows not contiguous)."""
    c = Paged()
    reqs = [(12, 50, c.table(50))]
    fused = torch.randn(12, c.h + c.hkv, c.d, generator=c.g)
    q = fused[:, : c.h]
    assert not q.is_contiguous()
    assert torch.equal(_run(native, c, q, reqs, None), _run(native, c, q.contiguous(), reqs, None))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_a_rows_bits_do_not_depend_on_threads_or_on_the_physical_blocks(native, dtype):
    c = Paged(dtype=dtype, seed=5)
    ctx = 300
    table = c.table(ctx)
    q = torch.randn(ctx, c.h, c.d, generator=c.g).to(dtype)
    reqs = [(ctx, ctx, table)]
    one, many, threads = _on_one_and_more_threads(native, c, q, reqs)
    assert torch.equal(one, many), f"1 thread vs {threads} ({isa_summary()})"
    # The same keys in other physical blocks: copy them over and rerun.
    moved = c.table(ctx)
    c.k[moved], c.v[moved] = c.k[table], c.v[table]
    assert torch.equal(_run(native, c, q, [(ctx, ctx, moved)], None), one), isa_summary()


@pytest.mark.parametrize("more", [2, 3, 4], ids=lambda n: f"{n}threads")
@pytest.mark.parametrize(
    "heads,dim,window",
    [((9, 3), 64, None), ((9, 3), 64, 1100), ((4, 1), 128, None)],
    ids=["gqa3", "window", "mqa-d128"],
)
def test_a_lone_bfloat16_decode_shared_by_the_threads_has_the_bits_of_one_thread(
    native, more, heads, dim, window
):
    """bfloat16 on AVX512-BF16 without tiles: a lone decode or a short verify chunk over a long context has fewer
    units (KV heads) than spread evenly over the threads, and the threads then share every unit's walk
    (csrc/paged_attention.cpp, run_bf16_shared: its blocks' scores, then its chunks of dims). The bits must be
    those of one thread walking each unit whole, on 2 threads and on 4 (3 threads take 3 units whole), and right.
    Shorter contexts, more rows and two requests of 3 KV heads (6 units) are walked whole: the same bits either
    way. Elsewhere bfloat16 runs other paths, which must hold the same property."""
    c = Paged(heads, dim, 16, torch.bfloat16, blocks=700, seed=7)
    cases = [
        [(1, 2000)],
        [(3, 1500)],
        [(5, 1100)],
        [(1, 530)],
        [(9, 2000)],
        [(13, 1000)],
        [(1, 1200), (2, 900)],
    ]
    for shape in cases:
        reqs = [(n, ctx, c.table(ctx)) for n, ctx in shape]
        q = torch.randn(sum(n for n, _ in shape), c.h, c.d, generator=c.g).to(torch.bfloat16)
        what = f"{shape}, window {window}, {more} threads ({isa_summary()})"
        one, many, _ = _on_one_and_more_threads(native, c, q, reqs, window, more=more)
        assert torch.equal(one, many), what
        err = (many.double() - c.reference(q, reqs, window)).abs().max().item()
        assert err <= TOL[torch.bfloat16], f"max error {err}: {what}"
        c.free += [b for *_, t in reqs for b in t]


def test_a_block_table_shorter_than_the_context_is_refused(native):
    c = Paged()
    with pytest.raises(ValueError, match="block table"):
        native.plan(c.meta([(1, 40, c.table(16))]))


def test_unsupported_shapes_are_refused_not_read_out_of_bounds(native):
    c = Paged(heads=(6, 4))  # 6 query heads over 4 kv heads: no whole group
    reqs = [(3, 3, c.table(3))]
    q = torch.randn(3, 6, c.d)
    with pytest.raises(ValueError, match="refused"):
        _run(native, c, q, reqs, None)


def test_without_the_kernels_cpu_falls_back_to_tiled_and_native_on_request_fails(monkeypatch, caplog):
    from engine.model.attention import chooser as dev
    from engine.model.kernels import build as native_kernels

    native_kernels.load.cache_clear()
    monkeypatch.setenv("BRINE_NATIVE_KERNELS", "0")
    try:
        monkeypatch.delenv("BRINE_ATTENTION_BACKEND", raising=False)
        with caplog.at_level("WARNING"):
            assert dev.select_backend(CPU, 8, 16, head_dim=64).name == "tiled"
        assert "C++ kernels are not available" in caplog.text
        monkeypatch.setenv("BRINE_ATTENTION_BACKEND", "native")
        with pytest.raises(RuntimeError, match="BRINE_NATIVE_KERNELS=0"):
            dev.select_backend(CPU, 8, 16, head_dim=64)
    finally:
        native_kernels.load.cache_clear()


def test_without_batch_invariance_cpu_keeps_the_native_kernel_and_sdpa_only_without_it(monkeypatch):
    from engine.model.attention import chooser as dev
    from engine.model.kernels import build as native_kernels

    monkeypatch.delenv("BRINE_ATTENTION_BACKEND", raising=False)
    if native_kernels.load()[0] is None:
        pytest.skip("no native kernels here")
    assert dev.select_backend(CPU, 8, 16, head_dim=64, batch_invariant=False).name == "native"
    native_kernels.load.cache_clear()
    monkeypatch.setenv("BRINE_NATIVE_KERNELS", "0")
    try:
        assert dev.select_backend(CPU, 8, 16, head_dim=64, batch_invariant=False).name == "sdpa"
    finally:
        native_kernels.load.cache_clear()


def test_no_compiler_is_a_reason_not_a_crash(monkeypatch):
    from engine.model.kernels import build as native_kernels

    native_kernels.load.cache_clear()
    monkeypatch.setenv("CXX", "/nonexistent/g++")
    monkeypatch.setattr(native_kernels.shutil, "which", lambda name: None)
    try:
        kernels, why = native_kernels.load()
        assert kernels is None and "compiler" in why
    finally:
        native_kernels.load.cache_clear()


def test_the_build_is_cached_per_source_and_cpu(monkeypatch, tmp_path):
    """A fresh cache builds once; a second load reuses the file; another source builds another file."""
    from engine.model.kernels import build as native_kernels

    if native_kernels._compiler() is None:
        pytest.skip("no C++ compiler here")
    monkeypatch.setenv("BRINE_CACHE", str(tmp_path))
    native_kernels.load.cache_clear()
    try:
        first, why = native_kernels.load()
        assert first is not None, why
        assert first.path.parent == tmp_path / "kernels" and first.path.is_file()
        mtime = first.path.stat().st_mtime_ns
        native_kernels.load.cache_clear()
        again, _ = native_kernels.load()
        assert again is not None and again.path == first.path and again.path.stat().st_mtime_ns == mtime
        changed = tmp_path / "paged_attention.cpp"
        changed.write_text(native_kernels.SOURCES[0].read_text() + "\n// another version\n")
        monkeypatch.setattr(native_kernels, "SOURCES", (changed, *native_kernels.SOURCES[1:]))
        native_kernels.load.cache_clear()
        other, why = native_kernels.load()
        assert other is not None, why
        assert other.path != first.path
        assert sorted(p.name for p in (tmp_path / "kernels").iterdir()) == sorted(
            [first.path.name, other.path.name]
        )
    finally:
        native_kernels.load.cache_clear()


def test_a_source_that_does_not_compile_is_a_reason_not_a_crash(monkeypatch, tmp_path):
    """One source failing among several (they compile side by side) gives the compiler's message, and no
    library or temporary file is left in the cache."""
    from engine.model.kernels import build as native_kernels

    if native_kernels._compiler() is None:
        pytest.skip("no C++ compiler here")
    broken = tmp_path / "broken.cpp"
    broken.write_text("this is not C++;\n")
    monkeypatch.setenv("BRINE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(native_kernels, "SOURCES", (*native_kernels.SOURCES[:1], broken))
    native_kernels.load.cache_clear()
    try:
        kernels, why = native_kernels.load()
    finally:
        native_kernels.load.cache_clear()
    assert kernels is None and "failed" in why and "broken.cpp" in why
    assert not list((tmp_path / "cache" / "kernels").iterdir())
