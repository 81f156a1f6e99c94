"""`--device` and `--dtype` resolution, and the choice of attention backend for a device.

`auto` dtype: bfloat16 on CUDA (float16 where the GPU lacks bf16). On CPU, bfloat16 where the CPU computes it
natively (AVX512-BF16 or AMX), else float32. Measured with benchmarks/prefill_bench.py on the default model
(SmolLM2-135M) on this project's 2-core AMD EPYC (AVX512-BF16), best of 5, side by side in one run:

    prefill  512 tok:   float32  661 tok/s, bfloat16 1089 tok/s (1.65x)
    prefill 2048 tok:   float32  558 tok/s, bfloat16  821 tok/s (1.47x)
    decode, 1 stream:   float32 18.8 tok/s, bfloat16 33.8 tok/s (1.80x)
    decode, 16 streams: float32  147 tok/s, bfloat16  312 tok/s (2.12x)

and bfloat16 still answers the smoke prompt like float32 (same 32 greedy tokens). Without native bf16 the
matmuls are emulated and slower than float32, hence the check. (Since then bfloat16 linears run on packed
oneDNN weights, `cpu_linear`, which made bfloat16 decode another ~1.4x faster; float32 linears run packed too
since batch invariance, because MKL's float32 F.linear rounds a row by its position in the product.)

On the tiers below (AVX512 without BF16, AVX2, portable: native_kernels), `auto` is float32: Brine's kernels
widen bfloat16 activations to float32 there (the quantized linears, the attention, the elementwise steps), and
dense bfloat16 linears compute in float32 (cpu_linear), so bfloat16 saves no arithmetic, only KV memory.
bfloat16 is still accepted there, and stays batch-invariant.
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from engine.model.attention import AttentionBackend, SdpaBackend

logger = logging.getLogger(__name__)

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@functools.cache
def cpu_has_native_bf16() -> bool:
    """AVX512-BF16 or AMX, unless BRINE_CPU_TIER makes Brine run as on a lower tier (native_kernels)."""
    from engine.model.native_kernels import selected_tier

    try:
        if selected_tier() is not None:
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


def default_backend(device: torch.device, head_dim: int, batch_invariant: bool = True) -> AttentionBackend:
    """The attention a freshly loaded model starts with: batch-invariant on CPU (native where the kernels
    build, else tiled), SDPA otherwise."""
    if device.type != "cpu":
        return SdpaBackend(device)
    if batch_invariant:
        return cpu_invariant_backend(device, head_dim)
    return _native_backend()[0] or SdpaBackend(device)


def _native_backend() -> tuple[AttentionBackend | None, str]:
    """(Brine's C++ attention, "") where the kernels build, else (None, why not). It is invariant, and on CPU
    also the fastest attention without invariance (it reads the cache in place, and lets the layers run as one
    native call: native_stack), so `--no-batch-invariant` keeps it too; SDPA only where it does not build."""
    from engine.model.native_kernels import load

    kernels, why = load()
    if kernels is None:
        return None, why
    from engine.model.native_attention import NativeBackend

    return NativeBackend(kernels), ""


def cpu_invariant_backend(
    device: torch.device, head_dim: int | None, choice: str = "auto"
) -> AttentionBackend:
    """Brine's C++ paged attention (`native_attention`) where it builds, else the tiled torch one. `choice`
    "native" insists (an error where it cannot build), "tiled" never tries."""
    if choice != "tiled":
        native, why = _native_backend()
        if native is not None:
            return native
        if choice == "native":
            raise RuntimeError(f"BRINE_ATTENTION_BACKEND=native, but the kernels are not available: {why}")
        _warn_no_native(why)
    from engine.model.tiled_attention import TiledBackend

    return TiledBackend(device, head_dim)


@functools.cache
def _warn_no_native(why: str) -> None:
    logger.warning(
        "CPU attention: the tiled torch backend (it copies each context every layer, so cached prompts cost "
        "more), because Brine's C++ kernels are not available: %s",
        why,
    )


def select_backend(
    device: torch.device,
    num_blocks: int,
    block_size: int,
    max_rows: int = 8192,
    *,
    head_dim: int | None = None,
    batch_invariant: bool = True,
) -> AttentionBackend:
    """FlexAttention on CUDA (reads K/V in place); on CPU the native kernel where it builds, else the tiled
    backend, or SDPA without batch invariance.

    BRINE_ATTENTION_BACKEND=native|tiled|sdpa|flex overrides the choice (flex on CPU runs compiled, for
    testing).
    """
    choice = os.environ.get("BRINE_ATTENTION_BACKEND", "auto").strip().lower()
    if choice not in ("auto", "native", "tiled", "sdpa", "flex"):
        raise ValueError(f"BRINE_ATTENTION_BACKEND must be auto, native, tiled, sdpa or flex, got {choice!r}")
    if choice in ("native", "tiled") or (choice == "auto" and device.type == "cpu" and batch_invariant):
        if device.type != "cpu" and choice == "native":
            raise ValueError("BRINE_ATTENTION_BACKEND=native runs on CPU only")
        if device.type == "cpu":
            return cpu_invariant_backend(device, head_dim, choice)
        from engine.model.tiled_attention import TiledBackend

        return TiledBackend(device, head_dim)
    if choice == "auto" and device.type == "cpu" and (native := _native_backend()[0]) is not None:
        return native  # without batch invariance too: see _native_backend
    if choice == "flex" or (choice == "auto" and device.type == "cuda"):
        try:
            from engine.model.flex_attention import FlexBackend, cuda_kv_tile

            if choice == "auto" and cuda_kv_tile(block_size) is None:
                logger.warning(
                    "block size %d is not a multiple of 16, which FlexAttention's CUDA kernel needs: "
                    "using the SDPA reference backend (it gathers each context every step)",
                    block_size,
                )
                return SdpaBackend(device)

            return FlexBackend(
                device,
                num_blocks,
                block_size,
                max_rows=max_rows,
                compile=True,
                batch_invariant=batch_invariant,
            )
        except ImportError:  # torch without FlexAttention (< 2.5)
            if choice == "flex":
                raise
    return SdpaBackend(device)
