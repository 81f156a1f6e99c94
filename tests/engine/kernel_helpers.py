"""Brine's CPU kernels for the tests that need them, or a skip that says why they are not here."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

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


def assert_rows_keep_their_bits(
    layer: Callable[[torch.Tensor], torch.Tensor], x: torch.Tensor, got: torch.Tensor, what: str
) -> None:
    """`got`, `layer(x)`: its rows are the bits of the same rows computed alone (every 4th), two, three and four
    together (a step of one row group, which the Q8 path runs straight from the records; AVX2's Q8 groups are
    otherwise 3 rows; AVX2's float32 groups take 2 blocks at a time up to 3 rows, one beside 4), seven together
    (groups of 4 and 3), in a slice of the batch (rows 5-29), and on one thread."""
    alone = torch.cat([layer(x[i : i + 1]) for i in range(0, x.shape[0], 4)])
    assert torch.equal(alone, got[0 : x.shape[0] : 4]), what
    assert torch.equal(layer(x[1:4]), got[1:4]), what
    assert torch.equal(layer(x[6:10]), got[6:10]), what
    assert torch.equal(layer(x[10:12]), got[10:12]), what
    assert torch.equal(layer(x[12:19]), got[12:19]), what
    assert torch.equal(layer(x[5:30]), got[5:30]), what
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(layer(x), got), what
    finally:
        torch.set_num_threads(threads)
