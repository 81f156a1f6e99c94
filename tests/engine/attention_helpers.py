"""Attention metadata for tests that drive the model directly, without a runner."""

from __future__ import annotations

import torch

from engine.model.attention.base import AttentionMetadata, slot_ids
from engine.model.transfer import index_tensor


def build_metadata(
    num_computed: list[int],
    query_lens: list[int],
    block_tables: list[list[int]],
    block_size: int,
    device: torch.device,
    is_causal: bool = True,
) -> AttentionMetadata:
    """Metadata for requests whose new tokens start at `num_computed[i]`, slots as the runner computes them."""
    slots: list[int] = []
    for start, n, table in zip(num_computed, query_lens, block_tables, strict=True):
        slots += slot_ids(table, start, start + n, block_size)
    return AttentionMetadata(
        query_lens=list(query_lens),
        context_lens=[c + n for c, n in zip(num_computed, query_lens, strict=True)],
        block_tables=block_tables,
        block_size=block_size,
        slot_mapping=index_tensor(slots, device),
        is_causal=is_causal,
    )
