"""Suite-wide test plumbing: CUDA-marked tests skip cleanly on machines without an NVIDIA GPU."""

from __future__ import annotations

import pytest


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
