"""Paged attention: the per-step metadata and the backend interface every backend (this package) satisfies.

The model computes q/k/v for every token of the flat batch, writes every new token's k/v into its slot
(`engine.kv_store.write_slots`, all tokens of the step before any attention in that layer), then asks a backend to attend each
request's queries over its whole context through its block table. A backend turns the step's
`AttentionMetadata` into a plan once per step (`plan`), and reuses it in every layer (`forward`).

The backends: `sdpa` (the reference, any device), `tiled` (batch-invariant torch ops), `native` (Brine's C++
kernel, reading the cache in place: CPU's default where it builds), `flex` (FlexAttention: CUDA's). `chooser`
picks one per engine.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Protocol

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """One step's attention inputs. Host lists drive planning; tensors live on the model's device."""

    query_lens: list[int]  # new tokens per request, in batch order
    context_lens: list[int]  # tokens in the cache after this step: cached + new
    block_tables: list[list[int]]  # per request: block ids covering at least context_lens[i] tokens
    block_size: int
    slot_mapping: torch.Tensor  # [num_tokens] int64: block_id * block_size + offset of every new token
    is_causal: bool = True
    query_starts: list[int] = field(default_factory=list)  # filled in __post_init__: len num_reqs + 1

    def __post_init__(self) -> None:
        starts = [0]
        for n in self.query_lens:
            starts.append(starts[-1] + n)
        self.query_starts = starts

    @property
    def num_tokens(self) -> int:
        return self.query_starts[-1]


def slot_ids(block_table: list[int], start: int, end: int, block_size: int) -> list[int]:
    """The cache slots of positions start..end-1 of a request (`block_id * block_size + offset`)."""
    return [block_table[p // block_size] * block_size + p % block_size for p in range(start, end)]


class AttentionBackend(Protocol):
    """What the model asks of a backend. Its capabilities are attributes, declared by each backend:

    - `reads_keys_from_cache`: `forward` reads every key and value from the caches, never its k and v
      arguments, so the model may write the cache itself and hand it empty ones (the fused RoPE + write);
    - `failed`: why the backend gave up and serves through its fallback (None while it runs as itself).
    """

    name: str
    reads_keys_from_cache: bool
    failed: str | None

    def plan(self, meta: AttentionMetadata) -> Any:
        """Per-step preparation shared by every layer (masks, index tensors)."""
        ...

    def forward(
        self,
        q: torch.Tensor,  # [num_tokens, num_heads, head_dim]
        k: torch.Tensor,  # [num_tokens, num_kv_heads, head_dim], already written to the cache
        v: torch.Tensor,
        k_cache: torch.Tensor,  # [num_blocks, block_size, num_kv_heads, head_dim]
        v_cache: torch.Tensor,
        plan: Any,
        sliding_window: int | None,
        scale: float,
    ) -> torch.Tensor:  # [num_tokens, num_heads, head_dim]
        ...
