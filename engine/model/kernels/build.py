"""Brine's own CPU kernels (engine/model/kernels/csrc/): compiled once per machine with the system C++ compiler.

Why not a torch C++ extension: its headers take ~30 s to compile and it needs ninja; these kernels take plain
pointers, so plain `g++` builds them (~7 s on 2 cores, the sources side by side), and ctypes (which releases
the GIL during the call) runs them.
They are built with `-march=native` for the CPU they run on, and `-fopenmp`: torch's wheel already loaded a
`libgomp.so.1`, so the kernels share torch's OpenMP thread team instead of starting a second one that would
compete with it for the cores.

The library is cached under `$BRINE_CACHE/kernels/`, named by a digest of the sources and header, the flags, the
compiler's version and this CPU's feature flags, so a changed source or a moved cache (another CPU) builds
anew. A build writes a temporary file and renames it into place: concurrent starts never load half a file.
Where no compiler is found or the build fails, `load()` returns None with the reason, and callers keep the
pure-torch path (the log says which one runs).

Tiers (csrc/simd.h): the same sources build for every CPU. `-march=native` picks this CPU's tier (AVX512-BF16,
AVX512 without BF16 with or without VNNI, AVX2 + FMA, or the portable one with no intrinsics), and `TIERS` names
explicit lower targets, so that any machine can build and test the tiers below its own
(tests/engine/test_kernel_tiers.py). `BRINE_CPU_TIER=avx512-bf16|avx512-vnni|avx512|avx2|portable` makes Brine
run as on such a CPU: the kernels are built for that target, and below AVX512-BF16 bfloat16 counts as not native
(device.cpu_has_native_bf16), as on a CPU without it. (avx512-bf16 is offered only on an AMX CPU: the same build
without the tiles; avx512-vnni only on a CPU with AVX512-BF16 as well: on a Cascade Lake or Ice Lake Xeon it is
the native build.)
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine.model.kernels.invariance import cpu_flags
from engine.model.loading.files import cache_dir

logger = logging.getLogger(__name__)

CSRC = Path(__file__).with_name("csrc")
SOURCE_NAMES = ("paged_attention.cpp", "quant_linear.cpp", "elementwise.cpp", "decoder_stack.cpp")
SOURCES = tuple(CSRC / name for name in SOURCE_NAMES)
HEADERS = (
    CSRC / "amx.h",
    CSRC / "dtypes.h",
    CSRC / "entry_points.h",
    CSRC / "simd.h",
    CSRC / "quant_q8.h",
)  # included by the sources (found through -I CSRC): part of the cache key
# The dtype codes of csrc/dtypes.h. The attention takes all three; the quantized linear and the elementwise
# kernels take float32 and bfloat16 only.
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
FLOAT32_BF16_CODES = {dt: code for dt, code in DTYPE_CODES.items() if dt != torch.float16}


def kv_dtype_runs(dtype: torch.dtype, kv_dtype: torch.dtype) -> bool:
    """Whether the kernels that read or write the KV cache (the attention, the rope write, the decoder stack)
    run a cache of `kv_dtype` under `dtype` activations: the same dtype, or float16 under float32
    (`--kv-cache-dtype float16`)."""
    return kv_dtype == dtype or (dtype == torch.float32 and kv_dtype == torch.float16)


ABI = 2  # what brine_paged_attention_abi() must return (bumped with the C signature)
QUANT_ABI = 3  # what brine_quant_linear_abi() must return
STACK_ABI = 5  # what brine_decoder_stack_abi() must return (bumped with native_stack's structures)
FLAGS = ("-O3", "-march=native", "-fopenmp", "-ffp-contract=off", "-shared", "-fPIC", "-std=c++17")
_X86 = platform.machine().lower() in ("x86_64", "amd64")
# Explicit lower targets: the -march that replaces "native", and the /proc/cpuinfo flags a CPU needs to run it.
# x86-64-v4 is AVX512F/BW/CD/DQ/VL without BF16 (Skylake-X and later), v3 is AVX2/FMA/F16C (Haswell and later).
# The portable build's sources use no intrinsics at all (simd.h's loops): on x86 it is built for x86-64-v2 with
# fused multiply-add, as the ARM64 CPUs it stands for have it (std::fma is then an instruction, not a call into
# libm, which would make the test runs slow, not different).
# The AVX512-BF16 build without AMX is a lower tier only on an AMX CPU, whose own build takes tiles: hence its
# need for amx_tile, which it does not use. On a Zen 4 or Zen 5 it is the native build, not built twice.
# avx512-vnni is the Cascade Lake / Ice Lake Xeon (AVX512 with VNNI, no BF16): the bulk of cloud AVX512 without
# BF16, whose Q8 activations take vpdpbusd (quant_q8.h), where avx512 (Skylake-X) takes vpmaddubsw. It is a lower
# tier only where the CPU has AVX512-BF16 too (hence that need); on those Xeons it is the native build.
V4 = frozenset({"avx512f", "avx512bw", "avx512cd", "avx512dq", "avx512vl"})
TIERS: dict[str, tuple[tuple[str, ...], frozenset[str]]] = {
    "avx512-bf16": (("-march=x86-64-v4", "-mavx512bf16"), V4 | {"avx512_bf16", "amx_tile"}),
    "avx512-vnni": (("-march=x86-64-v4", "-mavx512vnni"), V4 | {"avx512_vnni", "avx512_bf16"}),
    "avx512": (("-march=x86-64-v4",), V4),
    "avx2": (("-march=x86-64-v3",), frozenset({"avx2", "fma", "f16c", "bmi2", "movbe"})),
    "portable": (("-march=x86-64-v2", "-mfma") if _X86 else (), frozenset({"fma", "sse4_2"} if _X86 else ())),
}


@dataclass(frozen=True, slots=True)
class Elementwise:
    """csrc/elementwise.cpp's entry points (see fused_ops)."""

    add_rms_norm: ctypes._CFuncPtr  # type: ignore[name-defined]
    silu_mul: ctypes._CFuncPtr  # type: ignore[name-defined]
    rope_write: ctypes._CFuncPtr  # type: ignore[name-defined]


@dataclass(frozen=True, slots=True)
class Kernels:
    path: Path
    paged_attention: ctypes._CFuncPtr  # type: ignore[name-defined]
    # None where this CPU lacks what the kernel needs (AVX512 with BF16): see quant_linear.
    quant_linear: ctypes._CFuncPtr | None  # type: ignore[name-defined]
    # None where this CPU lacks AVX512 (see fused_ops).
    elementwise: Elementwise | None = None
    # The decoder layers in one call (see native_stack); None where the kernels it chains are missing.
    decoder_stack: ctypes._CFuncPtr | None = None  # type: ignore[name-defined]
    # What the library was compiled for: "amx-bf16" (AVX512-BF16 with AMX, granted), "avx512-bf16", "avx512",
    # "avx2" or "portable" (csrc/simd.h, quant_linear.cpp).
    tier: str = "unknown"


def _cpu_id() -> str:
    """What -march=native compiles for: the CPU's feature flags (the processor name where /proc has none)."""
    return " ".join(sorted(cpu_flags())) or platform.processor()


def _compiler() -> str | None:
    return shutil.which(os.environ.get("CXX", "g++")) or shutil.which("c++")


def tier_flags(tier: str | None) -> tuple[str, ...]:
    """The compiler flags for `tier` (None: this CPU's own, -march=native)."""
    if tier is None:
        return FLAGS
    return tuple(f for f in FLAGS if f != "-march=native") + TIERS[tier][0]


def runnable_tiers() -> list[str]:
    """The explicit tiers this CPU can run (every one whose instructions it has), best first."""
    if not _X86:
        return ["portable"]
    flags = cpu_flags()
    return [tier for tier, (_, needs) in TIERS.items() if needs <= flags]


def selected_tier() -> str | None:
    """BRINE_CPU_TIER's tier (None: auto, this CPU's own); ValueError for an unknown or unrunnable one."""
    name = os.environ.get("BRINE_CPU_TIER", "auto").strip().lower()
    if name in ("", "auto", "native"):
        return None
    if name not in TIERS:
        raise ValueError(f"BRINE_CPU_TIER must be auto, {', '.join(TIERS)}; got {name!r}")
    if name not in runnable_tiers():
        raise ValueError(f"BRINE_CPU_TIER={name}: this CPU lacks its instructions ({sorted(TIERS[name][1])})")
    return name


def _build(compiler: str, target: Path, csrc: Path | None = None, flags: tuple[str, ...] = FLAGS) -> None:
    """Compile each source to an object file, all at once (one g++ per source: ~10 s in series, about half
    on two cores), then link them into `target` by way of a temporary file. `csrc`: another checkout's
    sources (build_baseline); by default this tree's SOURCES."""
    target.parent.mkdir(parents=True, exist_ok=True)
    sources = list(SOURCES) if csrc is None else [csrc / name for name in SOURCE_NAMES]
    csrc = CSRC if csrc is None else csrc
    with tempfile.TemporaryDirectory(prefix=target.name, dir=target.parent) as work:
        objects = [str(Path(work) / f"{src.stem}.o") for src in sources]
        compile_flags = [f for f in flags if f != "-shared"] + ["-I", str(csrc)]
        jobs = [
            subprocess.Popen(
                [compiler, *compile_flags, "-c", "-o", obj, str(src)],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            )
            for src, obj in zip(sources, objects, strict=True)
        ]
        failed = None
        for job in jobs:
            _, err = job.communicate(timeout=300)
            if job.returncode and failed is None:
                failed = subprocess.CalledProcessError(job.returncode, job.args, stderr=err)
        if failed is not None:
            raise failed
        tmp = str(Path(work) / target.name)
        subprocess.run(
            [compiler, *flags, "-o", tmp, *objects], check=True, capture_output=True, text=True, timeout=300
        )
        os.replace(tmp, target)


def baseline_csrc(checkout: Path) -> Path:
    """Another checkout's kernel sources: engine/model/kernels/csrc, or engine/model/csrc before issue 34."""
    moved = checkout / "engine" / "model" / "kernels" / "csrc"
    return moved if moved.is_dir() else checkout / "engine" / "model" / "csrc"


def build_baseline(csrc: Path, target: Path) -> Kernels:
    """Another checkout's kernels (`baseline_csrc`), built into `target` and bound, for before / after
    benchmarks in one process (benchmarks/attention_bench.py --baseline), for the tier BRINE_CPU_TIER names
    (this CPU's own unless set), as this tree's are. Raises where they do not build or have other ABIs."""
    compiler = _compiler()
    if compiler is None:
        raise OSError("no C++ compiler (g++) found")
    _build(compiler, target, csrc, flags=tier_flags(selected_tier()))
    return _bind(target)


def _bind(path: Path) -> Kernels:
    lib = ctypes.CDLL(str(path))
    abis = (lib.brine_paged_attention_abi(), lib.brine_quant_linear_abi(), lib.brine_decoder_stack_abi())
    if abis != (ABI, QUANT_ABI, STACK_ABI):
        raise OSError(f"{path} has other ABIs {abis} than {(ABI, QUANT_ABI, STACK_ABI)}")
    fn = lib.brine_paged_attention
    i64, i32, ptr = ctypes.c_int64, ctypes.c_int, ctypes.c_void_p
    fn.argtypes = [i32, i32, ptr, i64, i64, ptr, ptr, ptr, ptr, i64, ptr, i64, i32, i32, i32, i32, i32, i32]
    fn.argtypes += [ctypes.c_float, i32]
    fn.restype = i32
    quant = None
    if (
        lib.brine_quant_linear_supported()
    ):  # (1 in every build of these sources; older ones: AVX512-BF16 only)
        quant = lib.brine_quant_linear
        quant.argtypes = [i32, ptr, i64, i64, i32, ptr, i64, i64, ptr, ptr, i64, i32, i32]
        quant.restype = i32
    elementwise = None
    if lib.brine_elementwise_supported():
        norm, silu, rope = lib.brine_add_rms_norm, lib.brine_silu_mul, lib.brine_rope_write
        norm.argtypes = [i32, ptr, ptr, ptr, ptr, ptr, i64, i64, ctypes.c_float, i32]
        silu.argtypes = [i32, ptr, ptr, i64, i64, i32]
        rope.argtypes = [i32, i32, ptr, i64, ptr, ptr, ptr, ptr, ptr, ptr, i64, i32, i32, i32, i32]
        norm.restype = silu.restype = rope.restype = i32
        elementwise = Elementwise(norm, silu, rope)
    stack = None
    if quant is not None and elementwise is not None:
        stack = lib.brine_decoder_stack
        stack.argtypes = [ptr]
        stack.restype = i32
    tier = "unknown"
    if hasattr(lib, "brine_kernel_tier"):  # (a baseline checkout's library may predate it)
        lib.brine_kernel_tier.restype = ctypes.c_char_p
        tier = lib.brine_kernel_tier().decode()
    return Kernels(path, fn, quant, elementwise, stack, tier)


_TIER_WORDS = {
    "amx-bf16": "amx-bf16 (avx512-bf16, with AMX tiles for the bfloat16 linears and attention)",
    "avx512-bf16": "avx512-bf16",
    "avx512-vnni": "avx512-vnni (no bf16)",
    "avx512": "avx512 (no bf16, no vnni)",
    "avx2": "avx2+fma",
    "portable": "portable (no intrinsics)",
}


def describe() -> str:
    """The kernels that run, for the startup log: 'avx512-vnni (no bf16)', 'avx2+fma (BRINE_CPU_TIER)', or
    'none (why)'."""
    kernels, why = load()
    if kernels is None:
        return f"none ({why})"
    words = _TIER_WORDS.get(kernels.tier, kernels.tier)
    return (
        f"{words} (BRINE_CPU_TIER)" if os.environ.get("BRINE_CPU_TIER", "auto") not in ("", "auto") else words
    )


@functools.cache
def load(tier: str | None = "env") -> tuple[Kernels | None, str]:
    """(the kernels, "") or (None, why not). Builds them on first use on this machine (~7 s per tier).
    `tier`: a TIERS name for that explicit target, None for this CPU's own, "env" (the default) for what
    BRINE_CPU_TIER says (this CPU's own unless set)."""
    if os.environ.get("BRINE_NATIVE_KERNELS", "1").strip().lower() in ("0", "off", "false", "no"):
        return None, "BRINE_NATIVE_KERNELS=0"
    try:
        tier = selected_tier() if tier == "env" else tier
        if tier is not None and tier not in runnable_tiers():
            return None, f"this CPU cannot run the {tier} tier"
    except ValueError as e:
        return None, str(e)
    flags = tier_flags(tier)
    compiler = _compiler()
    try:
        source = b"\0".join(path.read_bytes() for path in (*SOURCES, *HEADERS))
    except OSError as e:
        return None, f"kernel source missing: {e}"
    if compiler is None:
        return None, "no C++ compiler (g++) found"
    try:
        version = subprocess.run([compiler, "--version"], capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"{compiler} does not run: {e}"
    digest = hashlib.sha256(
        b"\0".join([source, " ".join(flags).encode(), version.encode(), _cpu_id().encode()])
    ).hexdigest()[:16]
    target = cache_dir() / "kernels" / f"brine_kernels-{digest}.so"
    try:
        if not target.is_file():
            logger.info(
                "building Brine's CPU kernels (%s) with %s into %s", tier or "native", compiler, target
            )
            t0 = time.perf_counter()
            _build(compiler, target, flags=flags)
            logger.info(
                "built Brine's CPU kernels in %.1f s (once per source, compiler and CPU)",
                time.perf_counter() - t0,
            )
        return _bind(target), ""
    except subprocess.CalledProcessError as e:
        return None, f"{compiler} failed: {(e.stderr or '').strip()[-500:]}"
    except (OSError, subprocess.SubprocessError) as e:
        return None, f"could not build or load the kernels: {e}"
