"""`--device` and `--dtype` resolution.

`auto` dtype: bfloat16 on CUDA (float16 where the GPU lacks bf16). On CPU, bfloat16 where the CPU computes it
natively (AVX512-BF16 or AMX), else float32. Why: with native bfloat16, prefill and decode run clearly faster
in bfloat16 than in float32 (benchmarks/prefill_bench.py and decode_bench.py measure it; figures in
benchmarks/results), and bfloat16 answers the smoke prompt like float32. Without native bfloat16 the matmuls
are emulated and slower than float32, hence the check. Linears run on packed oneDNN weights in both dtypes
(`layers.linear`): MKL's float32 F.linear rounds a row by its position in the product.

On the tiers below (AVX512 without BF16, AVX2, portable: `kernels.build`), `auto` is float32: Brine's kernels
widen bfloat16 activations to float32 there (the quantized linears, the attention, the elementwise steps), and
dense bfloat16 linears compute in float32 (`layers.linear`), so bfloat16 saves no arithmetic, only KV memory.
bfloat16 is still accepted there, and stays batch-invariant.

The attention backend for a device is chosen in `attention.chooser`.
"""

from __future__ import annotations

import functools

import torch

from engine.model.kernels.build import selected_tier

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX, unless BRINE_CPU_TIER makes Brine run as on a tier without them (kernels.build)."""
    try:
        tier = selected_tier()
        if tier is not None and "bf16" not in tier:
            return False
    except ValueError:  # an unknown tier: the kernels' load() reports it
        pass
    check = getattr(torch.cpu, "_is_avx512_bf16_supported", None)
    amx = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool((check and check()) or (amx and amx()))
    except RuntimeError:  # pragma: no cover - exotic builds
        return False


def cpu_auto_dtype() -> torch.dtype:
    return torch.bfloat16 if cpu_has_native_bf16() else torch.float32


def resolve_device(name: str) -> torch.device:
    """'auto' | 'cpu' | 'cuda' | 'cuda:N' -> torch.device; ValueError for CUDA without a GPU."""
    name = (name or "auto").strip().lower()
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cpu":
        return torch.device("cpu")
    if name.startswith("cuda"):
        if not torch.cuda.is_available():
            raise ValueError(
                f"device {name!r} requested but CUDA is not available (torch {torch.__version__})"
            )
        return torch.device(name)
    raise ValueError(f"unknown device {name!r}: expected auto, cpu or cuda")


def resolve_dtype(name: str, device: torch.device) -> torch.dtype:
    """'auto' | 'float32' | 'bfloat16' | 'float16' (also 'fp32', 'bf16', 'fp16', 'half') -> torch.dtype."""
    name = (name or "auto").strip().lower()
    aliases = {
        "fp32": "float32",
        "float": "float32",
        "bf16": "bfloat16",
        "fp16": "float16",
        "half": "float16",
    }
    name = aliases.get(name, name)
    if name == "auto":
        if device.type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return cpu_auto_dtype()
    if name not in DTYPES:
        raise ValueError(f"unknown dtype {name!r}: expected auto, float32, bfloat16 or float16")
    return DTYPES[name]


def resolve_kv_dtype(name: str, dtype: torch.dtype, device: torch.device) -> torch.dtype:
    """`--kv-cache-dtype`: 'auto' (the model dtype) or 'float16' (also 'fp16', 'half'). float16 under float32
    activations halves the bytes a step reads from a long cached context, which on CPU is what a warm request
    and a long decode wait on (docs/determinism.md#a-float16-kv-cache says what it costs); it needs Brine's
    CPU attention, which the runner checks once it has chosen the backend. ValueError for anything else."""
    name = (name or "auto").strip().lower()
    name = {"fp16": "float16", "half": "float16"}.get(name, name)
    if name == "auto" or (name == "float16" and dtype == torch.float16):
        return dtype
    if name != "float16":
        raise ValueError(f"unknown KV cache dtype {name!r}: expected auto or float16")
    if dtype != torch.float32:
        raise ValueError(
            f"--kv-cache-dtype float16 needs --dtype float32 (the model runs in {str(dtype).removeprefix('torch.')}, "
            "whose cache is already 16-bit)"
        )
    if device.type != "cpu":
        raise ValueError(f"--kv-cache-dtype float16 under float32 runs on the CPU only, not on {device}")
    return torch.float16
