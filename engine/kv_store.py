"""KVStore: the device tensors that hold the KV pages, how many pages a memory budget buys, and the one
function that writes them (`write_slots`, called by the model's attention layers).

Here, beside the runner that owns it, rather than in `kv_cache/`, which is block accounting only and never
imports torch. Layout per layer: `k_caches[layer]`, `v_caches[layer]`: [num_blocks, block_size, num_kv_heads,
head_dim], each a contiguous slice of one tensor [2 * num_layers, num_blocks, ...] (K of every layer, then V),
so that copying a block is one op for all layers, not one per layer and kind (`copy_blocks`). Token `offset` of block `block_id` lives at slot `block_id * block_size + offset`, i.e. row `slot`
of the flat view [num_blocks * block_size, num_kv_heads, head_dim], which is how `write_slots` addresses it.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

_SAME_BYTES = {
    1: torch.int8,
    2: torch.int16,
    4: torch.int32,
    8: torch.int64,
}  # itemsize -> a numpy-able dtype


def _bytes_per_block(
    num_layers: int, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
) -> int:
    return 2 * num_layers * block_size * num_kv_heads * head_dim * dtype.itemsize  # 2: K and V


class KVStore:
    def __init__(
        self,
        num_layers: int,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        if min(num_layers, num_blocks, block_size, num_kv_heads, head_dim) < 1:
            raise ValueError(
                f"KV cache dimensions must be >= 1: layers={num_layers} blocks={num_blocks} "
                f"block_size={block_size} kv_heads={num_kv_heads} head_dim={head_dim}"
            )
        self.num_layers = num_layers
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.dtype = dtype
        self.device = torch.device(device)
        shape = (2 * num_layers, num_blocks, block_size, num_kv_heads, head_dim)
        # zeros, not empty: a bug that reads an unwritten slot then gives zeros, not NaNs from stale memory.
        self.pages = torch.zeros(shape, dtype=dtype, device=self.device)
        self.k_caches: list[torch.Tensor] = list(self.pages[:num_layers].unbind(0))
        self.v_caches: list[torch.Tensor] = list(self.pages[num_layers:].unbind(0))
        self.bytes_per_block = _bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        logger.info(
            "KV cache: %d blocks x %d tokens = %d tokens fit (%d layers, %d KV heads x %d, %s on %s: %.1f MiB)",
            num_blocks,
            block_size,
            num_blocks * block_size,
            num_layers,
            num_kv_heads,
            head_dim,
            str(dtype).removeprefix("torch."),
            self.device,
            num_blocks * self.bytes_per_block / 2**20,
        )

    @classmethod
    def from_budget(
        cls,
        budget_bytes: int,
        num_layers: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> KVStore:
        """A store with as many whole blocks (K and V of every layer) as `budget_bytes` holds; ValueError when
        not even one fits."""
        if budget_bytes < 0:
            raise ValueError(f"memory budget must be >= 0 bytes, got {budget_bytes}")
        need = _bytes_per_block(num_layers, block_size, num_kv_heads, head_dim, dtype)
        if budget_bytes < need:
            raise ValueError(f"KV cache budget of {budget_bytes} bytes is below one block ({need} bytes)")
        return cls(num_layers, budget_bytes // need, block_size, num_kv_heads, head_dim, dtype, device)

    def copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole blocks, K and V of every layer, (source, destination) pairs: every source is read before
        any destination is written, so a block may be one pair's destination and a later pair's source."""
        if not copies:
            return
        # One strided copy per pair. On CPU through a numpy view of the same memory: torch's copy_ of the 60
        # strided pieces handed them to its thread pool (~0.6 ms in a server step), numpy copies them in place
        # on the calling thread (~10 us). A source that is also a destination is read out first.
        dsts = {dst for _, dst in copies}
        if self.device.type == "cpu":  # bfloat16 has no numpy dtype: the same bytes as int16 (float32: int32)
            arr = self.pages.view(_SAME_BYTES[self.dtype.itemsize]).numpy()
            saved = [arr[:, src].copy() if src in dsts else arr[:, src] for src, _ in copies]
            for (_, dst), block in zip(copies, saved, strict=True):
                arr[:, dst] = block
            return
        pages = self.pages
        reads = [pages[:, src].clone() if src in dsts else pages[:, src] for src, _ in copies]
        for (_, dst), piece in zip(copies, reads, strict=True):
            pages[:, dst].copy_(piece)


def write_slots(
    k_cache: torch.Tensor, v_cache: torch.Tensor, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """The one place that writes K/V pages: the model's attention layers call it with one layer's caches.

    k, v: [num_tokens, num_kv_heads, head_dim]; caches: [num_blocks, block_size, num_kv_heads, head_dim];
    slot_mapping: [num_tokens] integer slots (block_id * block_size + offset) on the caches' device, each
    distinct (duplicate slots write in undefined order).
    """
    slots = slot_mapping if slot_mapping.dtype == torch.int64 else slot_mapping.long()
    # [num_blocks, block_size, H, D] -> flat [num_slots, H, D] (a view: the caches are contiguous)
    k_cache.view(-1, *k_cache.shape[2:]).index_copy_(0, slots, k.to(k_cache.dtype))
    v_cache.view(-1, *v_cache.shape[2:]).index_copy_(0, slots, v.to(v_cache.dtype))
