"""Brine's kernels on every CPU tier this machine can run, not only its own (native_kernels.TIERS).

Each lower tier (AVX512 without BF16, AVX2 + FMA, the portable no-intrinsics build) is built for its explicit
target and checked as the native build is: every GGUF type the quantized linear runs, from a small GGUF file
written with the `gguf` package, against gguf's own dequantization and a float64 product; a row's bits alone,
batched, shifted and on one thread; the elementwise steps and the attention. The tiers' float32 arithmetic is
the same lane by lane (csrc/simd.h), so their results must also be bit-identical to each other; only the
AVX512-BF16 and AMX builds' bfloat16 products (vdpbf16ps, tdpbf16ps) may differ; an AMX Xeon also builds
the AVX512-BF16 one without tiles. Last, the default model's invariance workload
runs on each tier's kernels, in both dtypes. So an EPYC, an Ice Lake and an AMX Xeon all test the AVX2 and
portable paths, and every failure names the tier and the CPU.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from kernel_helpers import assert_rows_keep_their_bits, kernels_or_skip

from engine.model.kernels import build as native_kernels
from engine.model.kernels.invariance import isa_summary
from engine.model.layers.quant_linear import _GGUF_BLOCK, TYPE_NAMES, QuantLinear

LOWER = list(native_kernels.TIERS)
BLOCK_QUANTS = {2, 3, 6, 7, 8}  # the 32-weight types gguf-py can quantize; the K-quants get random blocks


def _tier(name: str) -> native_kernels.Kernels:
    if name not in native_kernels.runnable_tiers():
        pytest.skip(f"this CPU cannot run the {name} tier ({isa_summary()})")
    kernels, why = native_kernels.load(name)
    if kernels is None:
        pytest.skip(f"the {name} kernels do not build here: {why}")
    assert kernels.tier == name or (name == "portable" and kernels.tier == "portable"), kernels.tier
    return kernels


@pytest.fixture(scope="module", params=LOWER)
def tier(request) -> native_kernels.Kernels:
    return _tier(request.param)


def _gguf_weights(tmp_path, ggml_type: int, out_f: int, in_f: int, seed: int):
    """(the tensor's raw rows as Brine reads them from a GGUF file, gguf-py's dequantization of them)."""
    import gguf
    from gguf import quants

    from engine.model.loading.gguf_tensors import read_tensors

    rng = np.random.default_rng(seed)
    if ggml_type in BLOCK_QUANTS:
        w = rng.standard_normal((out_f, in_f)).astype(np.float32) * in_f**-0.5
        raw = quants.quantize(w, ggml_type)
    else:  # any bytes are a K-quant block, once its float16 scales are finite and small
        per, nbytes = _GGUF_BLOCK[ggml_type]
        raw = rng.integers(0, 256, (out_f, in_f // per, nbytes), dtype=np.uint8)
        scales = [slice(0, 2), slice(2, 4)] if ggml_type != 14 else [slice(208, 210)]
        for at in scales:
            d = np.abs(rng.standard_normal((out_f, in_f // per))) * 2e-3 + 1e-4
            raw[..., at] = d.astype(np.float16).view(np.uint8).reshape(out_f, in_f // per, 2)
        raw = raw.reshape(out_f, -1)
    path = tmp_path / f"{TYPE_NAMES[ggml_type]}.gguf"
    writer = gguf.GGUFWriter(str(path), "llama")
    writer.add_tensor("w", raw, raw_dtype=gguf.GGMLQuantizationType(ggml_type))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    t = read_tensors(path)["w"]
    assert t.tensor_type == ggml_type and t.shape == (in_f, out_f)
    stored = np.asarray(t.data).reshape(out_f, -1)
    dense = quants.dequantize(stored, ggml_type).astype(np.float64)
    return stored, torch.from_numpy(dense)


@pytest.mark.parametrize("ggml_type", list(TYPE_NAMES), ids=TYPE_NAMES.get)
def test_every_gguf_type_matches_gguf_dequantization_and_keeps_a_rows_bits(tier, tmp_path, ggml_type):
    out_f, in_f = 40, 512  # 40: a last, partial tile; 512: two K-quant super-blocks, sixteen 32-blocks
    raw, dense = _gguf_weights(tmp_path, ggml_type, out_f, in_f, seed=ggml_type)
    gen = torch.Generator().manual_seed(ggml_type)  # the same inputs every run
    bias = torch.randn(out_f, generator=gen)
    layer = QuantLinear(tier, ggml_type, raw, in_f, bias)
    native = QuantLinear(kernels_or_skip("quant_linear"), ggml_type, raw, in_f, bias)
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.randn(57, in_f, generator=gen).to(
            dtype
        )  # 57: past the 48 rows read straight from the records
        got = layer(x)
        ref = x.double() @ dense.T + bias.double()
        what = f"{TYPE_NAMES[ggml_type]} {dtype} on {tier.tier} ({isa_summary()})"
        if dtype == torch.float32:
            torch.testing.assert_close(
                got.double(), ref, rtol=1e-5, atol=2e-5 * ref.abs().max().item(), msg=what
            )
        else:  # a float32 sum rounded once to bfloat16: one bfloat16 step, plus what float32 summation of
            # in_f terms may lose (where the terms cancel, that is more than a step of the small result)
            sum_error = (x.double().abs() @ dense.abs().T + bias.double().abs()) * in_f * 2.0**-24
            step = ref.abs().clamp_min(2.0**-100) * 2.0**-7 + sum_error
            assert ((got.double() - ref).abs() <= step).all(), what
        assert_rows_keep_their_bits(layer, x, got, what)
        if dtype == torch.float32 or "bf16" not in (_native_tier() or ""):
            assert torch.equal(native(x), got), f"{what}: differs from this CPU's own build"


def _native_tier() -> str | None:
    kernels, _ = native_kernels.load(None)
    return None if kernels is None else kernels.tier


def test_the_lower_tiers_give_each_other_the_same_bits():
    """The AVX512, AVX2 and portable builds run the same lane arithmetic: bit-identical outputs, bfloat16
    activations included (they are widened to float32 on these tiers). (Not the AVX512-BF16 build, an AMX CPU's
    lower tier: its bfloat16 products are vdpbf16ps'.)"""
    from gguf import quants

    tiers = [_tier(name) for name in native_kernels.runnable_tiers() if "bf16" not in name]
    w = np.random.default_rng(9).standard_normal((24, 96)).astype(np.float32)
    x = torch.randn(13, 96)
    for ggml_type in (3, 8):
        raw = quants.quantize(w, ggml_type)
        for dtype in (torch.float32, torch.bfloat16):
            outs = [QuantLinear(k, ggml_type, raw, 96)(x.to(dtype)) for k in tiers]
            for k, out in zip(tiers, outs, strict=True):
                assert torch.equal(out, outs[-1]), f"{k.tier} vs {tiers[-1].tier}, {dtype}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_elementwise_steps_have_the_native_builds_bits(tier, dtype, monkeypatch):
    """Every tier's add+RMSNorm, SiLU x up and RoPE + cache write: the bits of this CPU's own build (the
    AVX512 code where it has AVX512; the scalar code elsewhere does its arithmetic lane by lane)."""
    from engine.model.kernels import fused_ops
    from engine.model.layers.activation import silu
    from engine.model.layers.norm import RMSNorm

    norm = RMSNorm(200, 1e-5)
    norm.weight.data = torch.randn(200)
    norm = norm.to(dtype)
    h, delta = (torch.randn(9, 200) * 3).to(dtype), torch.randn(9, 200).to(dtype)
    # 90 wide: a tail past the AVX2 code's 8 lanes; exp's clamps and infinities, and -0
    gate_up = torch.randn(9, 2 * 90) * 4
    gate_up[0, :6] = torch.tensor([100.0, -100.0, float("inf"), float("-inf"), -0.0, 88.5])
    gate_up = gate_up.to(dtype)
    qkv = torch.randn(9, (6 + 2 * 2) * 32).to(dtype)
    cos, sin = torch.rand(9, 1, 16).to(dtype), torch.rand(9, 1, 16).to(dtype)
    slots = torch.tensor([3, 1, 4, 15, 9, 2, 6, 5, 8])

    def run():
        k_cache, v_cache = torch.zeros(2, 8, 2, 32, dtype=dtype), torch.zeros(2, 8, 2, 32, dtype=dtype)
        q = fused_ops.rope_and_write(qkv, (cos, sin), slots, k_cache, v_cache, 6)
        assert q is not None
        return (
            *fused_ops.add_rms_norm(h, delta, norm),
            fused_ops.silu_mul(gate_up, silu),
            q,
            k_cache,
            v_cache,
        )

    native = run()
    monkeypatch.setattr(fused_ops, "load", lambda: (tier, ""))
    for name, a, b in zip(("sum", "norm", "silu", "q", "k", "v"), run(), native, strict=True):
        assert torch.equal(a, b), f"{name} on {tier.tier} ({isa_summary()})"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
def test_the_attention_matches_a_float64_reference_and_keeps_a_rows_bits(tier, dtype):
    from test_native_attention import TOL, Paged, _run

    from engine.model.attention.native import NativeBackend

    backend = NativeBackend(tier)
    c = Paged((6, 2), 64, 16, dtype, seed=3)
    reqs = [(n, ctx, c.table(ctx)) for n, ctx in ((40, 40), (9, 120), (1, 1), (1, 77))]
    q = torch.randn(sum(n for n, _, _ in reqs), c.h, c.d, generator=c.g).to(dtype)
    got = _run(backend, c, q, reqs, None)
    err = (got.double() - c.reference(q, reqs, None)).abs().max().item()
    assert err <= TOL[dtype], f"max error {err} on {tier.tier} ({isa_summary()})"
    alone = _run(backend, c, q[40:49], reqs[1:2], None)
    assert torch.equal(alone, got[40:49]), f"{tier.tier} ({isa_summary()})"
    if dtype == torch.float32 or "bf16" not in (_native_tier() or ""):
        native = NativeBackend(kernels_or_skip())
        assert torch.equal(_run(native, c, q, reqs, None), got), f"{tier.tier} vs this CPU's own build"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=str)
@pytest.mark.parametrize(
    "heads,window",
    [((9, 3), None), ((8, 2), None), ((8, 2), 50), ((10, 2), 50)],
    ids=["gqa3", "gqa4", "gqa4-window", "gqa5-window"],
)
def test_a_short_query_over_a_long_cached_context_has_the_bits_of_the_same_rows_inside_a_prompt(
    tier, dtype, heads, window
):
    """Items at the end of a long context (a question after a cached document, a verify chunk) take the
    keys-in-lanes path on AVX2 up to 64 rows (csrc/paged_attention.cpp, kKeyRowsTail), where the same rows
    further from the end of a longer query take the row-lanes one: the same bits either way, on 1 and 2
    threads, and right. Its value walk shares each value load among a few rows (kKeyValueRows: 3 on AVX2, 4 on
    AVX512); with 4 query heads per KV head, or 3, one of the tiers' groups holds rows of two tokens, which see
    different keys (one more at the end; with a window, one less at the start). The row-lanes path takes up to
    three groups of 16 rows at once on AVX512 (kLaneGroups): 5 query heads per KV head make items of 80 rows
    inside the prompt (three groups, then two) where the 13- and 9-token queries make 65 and 45 (three and
    two, and three)."""
    from test_native_attention import TOL, Paged, _on_one_and_more_threads, _run

    from engine.model.attention.native import NativeBackend

    backend = NativeBackend(tier)
    c = Paged(heads, 64, 16, dtype, seed=4)
    table = c.table(800)
    first = 655  # a 145-token query: items of 16 tokens from 655, so 687..702 is one, 113 tokens from its end
    q_long = torch.randn(800 - first, c.h, c.d, generator=c.g).to(dtype)
    inside = _run(backend, c, q_long, [(800 - first, 800, table)], window)
    for n in (13, 9, 1):  # 39, 27 and 3 rows, ending at position 699, over 700 - n cached keys
        reqs = [(n, 700, table[: -(-700 // 16)])]
        q = q_long[700 - n - first : 700 - first]
        what = f"{n} tokens, {dtype} on {tier.tier} ({isa_summary()})"
        one, got, _ = _on_one_and_more_threads(backend, c, q, reqs, window)
        assert torch.equal(got, inside[700 - n - first : 700 - first]), what
        assert torch.equal(one, got), what
        err = (got.double() - c.reference(q, reqs, window)).abs().max().item()
        assert err <= TOL[dtype], f"max error {err}: {what}"


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16], ids=str)
@pytest.mark.parametrize(
    "heads,dim,window",
    [((9, 3), 64, None), ((9, 3), 64, 600), ((4, 1), 128, None)],
    ids=["gqa3", "window", "mqa-d128"],
)
def test_a_lone_decode_spread_over_the_threads_has_the_bits_of_one_thread(tier, kv_dtype, heads, dim, window):
    """A lone decode (or a verify chunk, or a question at the end of a long context) has fewer units (KV
    heads) than spread evenly over the threads: on the tiers with the keys-in-lanes path each unit's blocks,
    then its dims, are split over the threads (csrc/paged_attention.cpp, run_split_units; on AVX2 also the
    9-token verify chunk's 27 rows and the 13-token question's 39), with the bits of the unit run whole on
    one thread, over float32 and float16 caches, with a sliding window, and right."""
    from test_native_attention import TOL, Paged, _on_one_and_more_threads

    from engine.model.attention.native import NativeBackend

    backend = NativeBackend(tier)
    c = Paged(heads, dim, 16, torch.float32, blocks=460, seed=6)
    c.k, c.v = c.k.to(kv_dtype), c.v.to(kv_dtype)
    for n, ctx in ((1, 2000), (3, 1500), (1, 530), (9, 2000), (13, 1000)):
        reqs = [(n, ctx, c.table(ctx))]
        q = torch.randn(n, c.h, c.d, generator=c.g)
        what = f"{n} over {ctx}, {kv_dtype} cache, window {window}, on {tier.tier} ({isa_summary()})"
        # exactly 2 threads: whether a step is split depends on the count (3 threads take 3 units whole)
        one, two, _ = _on_one_and_more_threads(backend, c, q, reqs, window, more=2)
        assert torch.equal(one, two), what
        k, v = c.k, c.v
        c.k, c.v = k.float(), v.float()
        try:
            err = (two.double() - c.reference(q, reqs, window)).abs().max().item()
        finally:
            c.k, c.v = k, v
        assert err <= TOL[torch.float32], f"max error {err}: {what}"


def test_a_float16_cache_under_float32_gives_the_bits_of_a_float32_cache_of_the_same_values(
    tier, monkeypatch
):
    """`--kv-cache-dtype float16`: every attention path (keys in lanes for a decode and a question at the end of
    a long context, rows in lanes for a prompt, the generic loops for another block size) widens each float16
    key and value exactly and does the float32 cache's arithmetic, so its bits are those of a float32 cache that
    holds the same float16-rounded numbers, on 1 and 2 threads; and the rope write rounds K and V to float16
    as torch's `.to(torch.float16)` does, with q untouched."""
    from test_native_attention import TOL, Paged, _on_one_and_more_threads

    from engine.model.attention.native import NativeBackend
    from engine.model.kernels import fused_ops

    backend = NativeBackend(tier)
    what = f"{tier.tier} ({isa_summary()})"
    for bs, shapes in ((16, ((1, 700), (13, 700), (40, 40), (9, 120), (70, 200))), (8, ((1, 77), (20, 50)))):
        c = Paged((9, 3), 64, bs, torch.float32, blocks=160 if bs == 16 else 40, seed=5)
        c.k, c.v = c.k.half().float(), c.v.half().float()  # the numbers a float16 cache holds
        reqs = [(n, ctx, c.table(ctx)) for n, ctx in shapes]
        q = torch.randn(sum(n for n, _, _ in reqs), c.h, c.d, generator=c.g)
        _, f32, _ = _on_one_and_more_threads(backend, c, q, reqs)
        c.k, c.v = c.k.half(), c.v.half()
        one, f16, _ = _on_one_and_more_threads(backend, c, q, reqs)
        assert f16.dtype == torch.float32, what
        assert torch.equal(f16, f32), f"block size {bs}: {what}"
        assert torch.equal(one, f16), f"block size {bs}, 1 thread: {what}"
        c.k, c.v = c.k.float(), c.v.float()
        err = (f16.double() - c.reference(q, reqs, None)).abs().max().item()
        assert err <= TOL[torch.float32], f"max error {err}: {what}"

    qkv = torch.randn(9, (6 + 2 * 2) * 32) * 40  # some values past float16's 11 bits, one past its range
    qkv[0, -1] = 1e6
    cos, sin = torch.rand(9, 1, 16), torch.rand(9, 1, 16)
    slots = torch.tensor([3, 1, 4, 15, 9, 2, 6, 5, 8])
    caches = {
        dt: (torch.zeros(2, 8, 2, 32, dtype=dt), torch.zeros(2, 8, 2, 32, dtype=dt))
        for dt in (torch.float32, torch.float16)
    }
    monkeypatch.setattr(fused_ops, "load", lambda: (tier, ""))
    qs = {dt: fused_ops.rope_and_write(qkv, (cos, sin), slots, *caches[dt], 6) for dt in caches}
    assert qs[torch.float16] is not None and torch.equal(qs[torch.float16], qs[torch.float32]), what
    for got, full in zip(caches[torch.float16], caches[torch.float32], strict=True):
        assert torch.equal(got, full.half()), what
    assert caches[torch.float16][1].isinf().sum() == 1, what


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_default_model_answers_as_if_alone_on_every_tier(tier, dtype, monkeypatch):
    """The invariance property test's check on the tier's kernels, on a smaller fixed workload (three
    requests sharing a 32-token prefix, one seeded; 16-token steps that chunk every prompt; a pool that
    forces preemption): the default model's linears, elementwise steps, attention and the one-call decoder
    stack all run there, as on a CPU of that tier."""
    from test_invariance_property import check_small_workload

    from engine.model import device

    monkeypatch.setenv("BRINE_CPU_TIER", tier.tier)
    for cached in (native_kernels.load, device.cpu_has_native_bf16):
        cached.cache_clear()
    try:
        assert native_kernels.load()[0] is not None and native_kernels.load()[0].tier == tier.tier
        check_small_workload(dtype, seed=11, caching=False)
    finally:
        monkeypatch.delenv("BRINE_CPU_TIER")
        for cached in (native_kernels.load, device.cpu_has_native_bf16):
            cached.cache_clear()


def test_the_startup_log_names_the_tier(monkeypatch):
    """What ModelRunner's startup line says after "kernels": the tier, and that BRINE_CPU_TIER chose it."""
    kernels_or_skip()
    native = native_kernels.describe()
    words = ("amx-bf16", "avx512-bf16", "avx512-vnni", "avx512", "avx2+fma", "portable")
    assert native.split(" ")[0] in words, native
    monkeypatch.setenv("BRINE_CPU_TIER", "portable")
    native_kernels.load.cache_clear()
    try:
        assert native_kernels.describe() == "portable (no intrinsics) (BRINE_CPU_TIER)"
        monkeypatch.setenv("BRINE_CPU_TIER", "sse9")
        native_kernels.load.cache_clear()
        assert native_kernels.describe().startswith("none (BRINE_CPU_TIER must be auto")
    finally:
        monkeypatch.delenv("BRINE_CPU_TIER")
        native_kernels.load.cache_clear()


# Every x86 tier's target, the AMX one (the native build of an AMX Xeon) included: a machine runs only the
# tiers its CPU has, so without this an AVX2 developer would never compile the AVX512 or AMX code.
COMPILE_TARGETS = {
    **{name: flags for name, (flags, _) in native_kernels.TIERS.items()},
    "amx-bf16": ("-march=sapphirerapids",),
}


@pytest.mark.skipif(not native_kernels._X86, reason="the x86 targets need an x86 compiler")
def test_every_source_compiles_for_every_x86_tier_even_those_this_cpu_cannot_run():
    """Each source, checked by the compiler (-fsyntax-only: types and every template used, no code) for each
    tier's target: a type error in a branch of simd.h or of a kernel that only a higher tier compiles shows up
    on every machine, not first on the CPUs that run it."""
    import subprocess

    compiler = native_kernels._compiler()
    if compiler is None:
        pytest.skip("no C++ compiler")
    base = [f for f in native_kernels.FLAGS if f not in ("-march=native", "-shared")]
    jobs = {
        (tier, src.name): subprocess.Popen(
            [compiler, *base, *flags, "-fsyntax-only", "-I", str(native_kernels.CSRC), str(src)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for tier, flags in COMPILE_TARGETS.items()
        for src in native_kernels.SOURCES
    }
    failed = {}
    for key, job in jobs.items():
        _, err = job.communicate(timeout=300)
        if job.returncode:
            failed[key] = err[-2000:]
    assert not failed, failed


# ARM64 (Graviton, Ampere, Apple silicon under Linux) runs the portable build, compiled for its own CPU. No ARM
# machine is at hand, so an x86 one cross-compiles the kernels with Debian's g++-aarch64-linux-gnu and runs them
# under qemu-user-static (.ci/run installs both): GCC 12's C++ has no _Float16 on ARM64, which once left ARM users
# with no kernels at all, and only an ARM build shows whether its vectors (simd.h's GNU vectors, NEON there) give
# the x86 tiers' bits.
ARM64_CXX = "aarch64-linux-gnu-g++"
QEMU_ARM64 = "qemu-aarch64-static"
DIGEST_SRC = Path(__file__).with_name("csrc") / "cross_arch_digest.cpp"
KERNEL_SOURCES = [s for s in native_kernels.SOURCES if s.name != "decoder_stack.cpp"]


def _arm64_cxx() -> str:
    import shutil

    if not native_kernels._X86:
        pytest.skip("the ARM64 checks cross-compile from x86")
    cxx = shutil.which(ARM64_CXX)
    if cxx is None:
        pytest.skip(f"no {ARM64_CXX} (apt-get install g++-aarch64-linux-gnu)")
    return cxx


def _compiling(cxx: str, flags: list[str], out, sources):
    import subprocess

    base = [f for f in native_kernels.FLAGS if f not in ("-march=native", "-shared", "-fPIC")]
    cmd = [cxx, *base, *flags, "-I", str(native_kernels.CSRC), "-o", str(out), *map(str, sources)]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_every_source_compiles_for_arm64():
    """Each kernel source compiles for a generic ARMv8-A (what an ARM64 CPU without -march=native extras gets):
    types and every template, as the x86 tiers' check above."""
    cxx = _arm64_cxx()
    import subprocess

    base = [f for f in native_kernels.FLAGS if f not in ("-march=native", "-shared")]
    failed = {}
    for src in native_kernels.SOURCES:
        job = subprocess.run(
            [cxx, *base, "-fsyntax-only", str(src)], capture_output=True, text=True, timeout=300
        )
        if job.returncode:
            failed[src.name] = job.stderr[-2000:]
    assert not failed, failed


def test_an_arm64_build_gives_the_bits_of_this_machines_tiers(tmp_path):
    """tests/engine/csrc/cross_arch_digest.cpp runs every kernel entry point a step calls (each record kind of
    the quantized linears with float32 and Q8 activations, the attention over float32 and float16 caches, the
    elementwise steps) on fixed inputs and prints a digest of the outputs: built for ARM64 and run under qemu, it
    must print what the portable build and this CPU's own build print here."""
    import shutil
    import subprocess

    cxx = _arm64_cxx()
    qemu = shutil.which(QEMU_ARM64)
    if qemu is None:
        pytest.skip(f"no {QEMU_ARM64} (apt-get install qemu-user-static)")
    host = native_kernels._compiler()
    if host is None:
        pytest.skip("no C++ compiler")
    sources = [DIGEST_SRC, *KERNEL_SOURCES]
    builds = {  # side by side: each is a minute of -O3 on one core
        "portable": _compiling(
            host, list(native_kernels.TIERS["portable"][0]), tmp_path / "portable", sources
        ),
        "native": _compiling(host, ["-march=native"], tmp_path / "native", sources),
        "arm64": _compiling(cxx, ["-static"], tmp_path / "arm64", sources),
    }
    for name, job in builds.items():
        _, err = job.communicate(timeout=900)
        assert job.returncode == 0, (name, err[-3000:])
    digests = {
        name: subprocess.run([str(tmp_path / name)], capture_output=True, text=True, timeout=120).stdout
        for name in ("portable", "native")
    }
    run = subprocess.run([qemu, str(tmp_path / "arm64")], capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout + run.stderr
    digests["arm64 (qemu)"] = run.stdout
    assert len(set(digests.values())) == 1 and run.stdout.strip(), (digests, isa_summary())
