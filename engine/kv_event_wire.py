"""KV cache events in vLLM's wire format: what a KV-aware router (vllm-router's `kv_aware` policy) decodes.

One ZMQ message is three frames: the topic, the batch's sequence number (8 bytes, big-endian, from 0, one per
batch) and the msgpack payload. The payload is a `KVEventBatch` as vLLM encodes it: an array
`[ts, events, data_parallel_rank]`, each event a map whose `"type"` names its class:

- `BlockStored`: `block_hashes` (bytes, opaque to the router), `parent_block_hash` (bytes or nil),
  `token_ids`, `block_size`, `lora_id` (nil), `medium`, `lora_name` (the operator's adapter name, nil for
  the base model: vllm-router's LoRA-aware routing reads it; the adapter is also folded into the hashes),
  `group_idx` (0: one KV cache group), `kv_cache_spec_kind` ("full": full attention).
- `BlockRemoved`: `block_hashes`, `medium`, `group_idx`.
- `AllBlocksCleared`: no field.

vLLM's optional `extra_keys` (which would carry a cache salt) is never sent: a tenant or salt is folded into
Brine's hashes and never leaves the process. The router hashes `token_ids` itself and uses Brine's hashes only
to chain a block to its parent and to find it again in `BlockRemoved`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgpack

from kv_cache.stats import AllBlocksCleared, BlockRemoved, BlockStored, KVCacheEvent

# vLLM's name for the engine's own KV pool. Routers rank it above host or external tiers; on a CPU server the
# pool is in host memory, but it is still the one the engine computes from, which is what the router means.
MEDIUM = "GPU"
END_SEQ = (-1).to_bytes(8, "big", signed=True)  # ends a replay


def event_to_wire(event: KVCacheEvent) -> dict[str, Any]:
    """One in-process event as the map vLLM's msgpack encoder writes for it."""
    if isinstance(event, BlockStored):
        return {
            "type": "BlockStored",
            "block_hashes": list(event.block_hashes),
            "parent_block_hash": event.parent_block_hash,
            "token_ids": list(event.token_ids),
            "block_size": event.block_size,
            "lora_id": None,
            "medium": MEDIUM,
            "lora_name": event.lora_name,
            "group_idx": 0,
            "kv_cache_spec_kind": "full",
        }
    if isinstance(event, BlockRemoved):
        return {
            "type": "BlockRemoved",
            "block_hashes": list(event.block_hashes),
            "medium": MEDIUM,
            "group_idx": 0,
        }
    if isinstance(event, AllBlocksCleared):
        return {"type": "AllBlocksCleared"}
    raise TypeError(f"not a KV cache event: {event!r}")


def encode_batch(events: Sequence[KVCacheEvent], ts: float, data_parallel_rank: int = 0) -> bytes:
    """The msgpack payload of one batch (`use_bin_type`: hashes go out as msgpack bin, as vLLM's do)."""
    body = [ts, [event_to_wire(e) for e in events], data_parallel_rank]
    return msgpack.packb(body, use_bin_type=True)


def seq_bytes(seq: int) -> bytes:
    return seq.to_bytes(8, "big", signed=True)
