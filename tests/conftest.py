"""Suite-wide test plumbing: CUDA-marked tests skip cleanly on machines without an NVIDIA GPU, and the report
header names the CPU features that decide which kernels torch runs (batch-invariance results depend on them),
as does the summary under -q."""

from __future__ import annotations

import pytest


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
