"""Brine's CPU kernels for the tests that need them, or a skip that says why they are not here."""

from __future__ import annotations

import pytest

from engine.model.kernels import build as native_kernels
from engine.model.kernels.invariance import isa_summary


def kernels_or_skip(part: str | None = None, what: str = "") -> native_kernels.Kernels:
    """The built kernels; skips when they do not build here, or when `part` (a `Kernels` field such as
    `quant_linear`, `elementwise`, `decoder_stack`) is missing on this CPU, naming `what` and the ISA."""
    kernels, why = native_kernels.load()
    if kernels is None:
        pytest.skip(f"Brine's C++ kernels are not available here: {why}")
    if part is not None and getattr(kernels, part) is None:
        pytest.skip(f"this CPU lacks {what or part} ({isa_summary()})")
    return kernels
