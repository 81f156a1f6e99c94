"""The one choice of attention backend for an engine (the runner calls `choose_backend` once).

CPU: Brine's C++ paged attention (`native`) where the kernels build, with or without batch invariance (it is
invariant, reads the cache in place, and lets the layers run as one native call); else the tiled torch backend
(invariant) or SDPA (`--no-batch-invariant`). CUDA: FlexAttention over the block tables, or SDPA where the
block size does not suit its kernel or torch has no FlexAttention.
`BRINE_ATTENTION_BACKEND=native|tiled|sdpa|flex` overrides the choice (flex on CPU runs compiled, for testing).
"""

from __future__ import annotations

import functools
import logging
import os

import torch

from engine.model.attention.base import AttentionBackend
from engine.model.attention.flex import FlexBackend, cuda_kv_tile
from engine.model.attention.native import NativeBackend
from engine.model.attention.sdpa import SdpaBackend
from engine.model.attention.tiled import TiledBackend
from engine.model.kernels.build import load as load_kernels

logger = logging.getLogger(__name__)


def _native_backend() -> tuple[AttentionBackend | None, str]:
    """(Brine's C++ attention, "") where the kernels build, else (None, why not). It is invariant, and on CPU
    also the fastest attention without invariance (it reads the cache in place, and lets the layers run as one
    native call: native_stack), so `--no-batch-invariant` keeps it too; SDPA only where it does not build."""
    kernels, why = load_kernels()
    if kernels is None:
        return None, why
    return NativeBackend(kernels), ""


def cpu_invariant_backend(
    device: torch.device, head_dim: int | None, choice: str = "auto"
) -> AttentionBackend:
    """Brine's C++ paged attention (`attention.native`) where it builds, else the tiled torch one. `choice`
    "native" insists (an error where it cannot build), "tiled" never tries."""
    if choice != "tiled":
        native, why = _native_backend()
        if native is not None:
            return native
        if choice == "native":
            raise RuntimeError(f"BRINE_ATTENTION_BACKEND=native, but the kernels are not available: {why}")
        _warn_no_native(why)
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
        return TiledBackend(device, head_dim)
    if choice == "auto" and device.type == "cpu" and (native := _native_backend()[0]) is not None:
        return native  # without batch invariance too: see _native_backend
    if choice == "flex" or (choice == "auto" and device.type == "cuda"):
        try:
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
