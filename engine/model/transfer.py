"""Host -> device copies that never make the host wait for the GPU.

A plain `tensor.to("cuda")` (and `torch.tensor(data, device="cuda")`, and indexing a CUDA tensor with a Python
list) copies from pageable memory and then synchronises the stream: the CPU waits for every kernel already
queued, so a copy made mid-step costs a full device sync. Per step we allow exactly one sync, the `.tolist()`
of the results; every other host data goes through `to_device`: staged in pinned memory and copied with
`non_blocking` (the caching host allocator keeps the pinned buffer alive until the copy has run).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def to_device(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`host` (a CPU tensor) on `device`, without blocking the host on queued GPU work."""
    if device.type == "cpu":
        return host
    if device.type == "cuda":
        host = host.pin_memory()
    return host.to(device, non_blocking=True)


def index_tensor(values: Sequence[int], device: torch.device) -> torch.Tensor:
    """An int64 index tensor on `device` built from host ints (see `to_device`)."""
    return to_device(torch.tensor(values, dtype=torch.int64), device)
