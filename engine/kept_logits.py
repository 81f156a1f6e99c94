"""The logits after a prompt's last token, kept so that the same prompt sent again samples its first token
with no forward at all.

A prompt sent again hits its whole KV in the prefix cache (kv_cache.manager: full blocks, then the tail),
except its last token, which is recomputed because its logits are needed. That one-token step reads every
weight once and attends over the whole context: ~11 ms for the default model over 2,000 cached tokens on two
cores, most of the time to first token of a repeated prompt, where llama.cpp answers from the logits it kept.
So the runner keeps the logits of each prompt's last position (the row it samples a request's first token
from) under `KVCacheManager.sequence_key` (the tokens and their namespace: salt, tenant, adapter), and the
scheduler admits a request whose every token's KV is cached and whose logits are kept with nothing to compute
(`ScheduledRequest.kept_logits`).

Exactly the same tokens and logprobs: the kept row is the raw float32 logits the model computed at that
position (before penalties, masks, temperature), and Brine's kernels are batch- and chunk-invariant, so the row
a new forward would compute there is bit-identical to it (tests/engine/test_kept_logits.py checks it against a
run with caching off). On CUDA, whose linears are not invariant yet (docs/determinism.md), the row is the one
the first request computed, as close to a recompute as any two batches there are. Nothing crosses namespaces: the key carries the namespace as a block hash does, and the
KV it needs must be hit under the same key chain. A tenant's reset drops its entries (`forget`), a cache reset
all of them.

Only the runner's step thread reads and writes it; the scheduler, on the same thread, only asks `in`.
Bounded: the least recently used entry goes past `capacity`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable

import torch

# At most this many bytes of kept rows (float32 over the vocabulary: 192 KiB for a 49,152-token vocabulary, so
# 64 rows in 12 MiB; 600 KiB for Qwen's 151,936), and at most MAX_ENTRIES rows.
MAX_BYTES = 32 << 20
MAX_ENTRIES = 64


class KeptLogits:
    def __init__(self, vocab_size: int, capacity: int | None = None) -> None:
        self.capacity = (
            capacity if capacity is not None else max(1, min(MAX_ENTRIES, MAX_BYTES // (4 * vocab_size)))
        )
        self._rows: OrderedDict[bytes, tuple[torch.Tensor, Hashable | None]] = OrderedDict()
        self.hits = 0  # rows given back (for tests and the profile)

    def __contains__(self, key: object) -> bool:
        return key in self._rows

    def __len__(self) -> int:
        return len(self._rows)

    def get(self, key: bytes) -> torch.Tensor | None:
        """The kept row (never written to by anyone: callers copy it into their logits), freshened."""
        entry = self._rows.get(key)
        if entry is None:
            return None
        self._rows.move_to_end(key)
        self.hits += 1
        return entry[0]

    def put(self, key: bytes, row: torch.Tensor, owner: Hashable | None) -> None:
        """Keep a copy of `row` (one position's float32 logits) under `key`."""
        self._rows[key] = (row.detach().float().clone(), owner)
        self._rows.move_to_end(key)
        while len(self._rows) > self.capacity:
            self._rows.popitem(last=False)

    def forget(self, owner: Hashable) -> int:
        """Drop `owner`'s rows (a tenant's reset of its prefixes); returns how many."""
        mine = [k for k, (_, o) in self._rows.items() if o == owner]
        for k in mine:
            del self._rows[k]
        return len(mine)

    def clear(self) -> None:
        self._rows.clear()
