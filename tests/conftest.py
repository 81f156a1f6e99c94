"""Suite-wide test plumbing: CUDA-marked tests skip cleanly on machines without an NVIDIA GPU, and the report
header names the CPU features that decide which kernels torch runs (batch-invariance results depend on them),
as does the summary under -q."""

from __future__ import annotations

import os
import re
import tempfile

import pytest


def _inductor_cache_per_capability() -> None:
    """A run that holds torch to a lesser CPU (ATEN_CPU_CAPABILITY=avx2, as the README's tier emulation does)
    gets an inductor cache of its own. torch 2.13 keys its cache without that variable: a flex attention
    compiled by a native run and then loaded under `avx2` on the same machine gave chunked rows other bits than
    the whole prompt (test_batch_invariance's compiled-on-CPU test failed; with a fresh cache it passed)."""
    cap = os.environ.get("ATEN_CPU_CAPABILITY")
    if cap and "TORCHINDUCTOR_CACHE_DIR" not in os.environ:
        user = re.sub(r"[^A-Za-z0-9_.-]", "_", os.environ.get("USER", "user"))
        tag = re.sub(r"[^A-Za-z0-9_.-]", "_", cap)
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(
            tempfile.gettempdir(), f"torchinductor_{user}_{tag}"
        )


_inductor_cache_per_capability()


def _isa_line() -> str:
    from engine.model.kernels.invariance import isa_summary

    return f"brine kernels: {isa_summary()}"


def pytest_report_header(config: pytest.Config) -> str:
    return _isa_line()


def pytest_terminal_summary(terminalreporter: pytest.TerminalReporter, config: pytest.Config) -> None:
    """`make test` runs `pytest -q`, which hides the report header: the CPU line goes at the end instead, so
    that every CI log says which CPU (and so which kernels) its results came from."""
    if config.get_verbosity() < 0:
        terminalreporter.write_line(_isa_line())


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if not any(item.get_closest_marker("cuda") for item in items):
        return
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs an NVIDIA GPU (CUDA not available)")
    for item in items:
        if item.get_closest_marker("cuda"):
            item.add_marker(skip)
