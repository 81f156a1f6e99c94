"""`LoRAAdapter`: one loaded adapter, as the manager registers it and the wrapped linears read it."""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn


@dataclass(slots=True, eq=False)
class LoRAAdapter:
    """A loaded adapter: its name, fingerprint, rank, and one delta module per (layer, target) it changes."""

    name: str
    path: str
    fingerprint: str
    rank: int
    lora_id: int  # 1, 2, ... in load order (vLLM's lora_int_id); never reused
    deltas: dict[tuple[int, str], nn.Module]  # (layer, fused linear) -> its delta (engine.lora.delta)
    num_targets: int = 0  # (layer, target) pairs the adapter changes

    @property
    def key(self) -> tuple[str, str]:
        """What the cache namespace carries: (name, fingerprint)."""
        return (self.name, self.fingerprint)
