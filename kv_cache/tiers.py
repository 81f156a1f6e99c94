"""KV tiers behind the block pool: the interface every tier keeps, the LRU index that bounds one, and the
host-RAM tier. Torch-free: a tier stores a block's KV as opaque bytes; turning device pages into those bytes
and back is `engine.kv_tiers`' job, and the disk tier (files, encryption) is `engine.kv_disk`'s.

A block in a tier is found by its block hash (`kv_cache.hashing`), which already carries the block's
namespace and, when a disk dir is used, the identity of the model that computed it (the hash seed is
derived from it: `engine.kv_disk`), so a hit is always KV this request would compute itself.

Rules a tier keeps (`TierStore`):
- `get` returns the exact bytes `put` stored under that hash, or None (a miss: absent, evicted, corrupt); it
  never raises for a bad entry, it drops it.
- `put` never raises either: a tier that cannot store any more (disk full, unwritable dir) turns itself off
  (`enabled` False) and logs why; lookups then miss.
- `forget(owner)` drops every block of that owner (a tenant's reset), `clear()` every block (a global reset);
  a `put` queued before either and finishing after it must not bring a block back (`epoch`).
- Size stays within the capacity given: the least recently used blocks go first.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Generic, Protocol, TypeVar

from kv_cache.hashing import BlockHash
from kv_cache.namespace import Owner

logger = logging.getLogger(__name__)

# The namespace a block's contents are encrypted under: CacheNamespace.keys() of its request for a private
# block, () for a block of a declared public prefix (shared by every namespace).
NamespaceKeys = tuple[tuple[str, ...], ...]


@dataclass(slots=True)
class TierBlock:
    """One pool block on its way to or from a tier."""

    block_id: int  # the pool block holding (write) or receiving (load) the KV
    block_hash: BlockHash
    namespace: NamespaceKeys
    owner: Owner | None  # the tenant whose reset forgets it; None for public / unowned blocks
    # Retention (wall-clock seconds): a tier evicts this block only after every unretained one until then.
    retain_until: float = 0.0


@dataclass(slots=True)
class LoadPlan:
    """A request's blocks to load from tiers into fresh pool blocks before it is scheduled again."""

    request_id: str
    blocks: list[TierBlock]
    tiers: list[str]  # the tier each block is read from ("host" | "disk")
    abandoned: bool = False  # the request finished while loading: free the blocks, cache nothing
    epoch: int = 0  # the manager's reset count when it started: a reset since then caches nothing it loads


class TierStore(Protocol):
    """One tier's storage (host RAM, disk): bytes by block hash."""

    name: str
    epoch: int  # bumped by forget / clear; a put carries the epoch it was queued at

    @property
    def enabled(self) -> bool: ...

    def contains(self, block_hash: BlockHash) -> bool: ...

    def get(self, block: TierBlock) -> bytes | None: ...

    def put(self, block: TierBlock, payload: bytes, epoch: int) -> None: ...

    def forget(self, owner: Owner) -> int: ...

    def clear(self) -> None: ...

    def close(self) -> None: ...


class TierLookup(Protocol):
    """What the KV cache manager asks of the tiers behind its pool (engine.kv_tiers.KVTiers satisfies it)."""

    def find(self, hashes: Sequence[BlockHash]) -> list[str]:
        """The tier holding each of the leading `hashes`, stopping at the first that none holds."""
        ...

    def contains(self, block_hash: BlockHash) -> bool:
        """True when every tier already holds the block (no need to write it again)."""
        ...


K = TypeVar("K", str, bytes)  # a tier's key: the block hash (host) or the keyed file name (disk)


@dataclass(slots=True)
class TierEntry:
    size: int
    owner: Owner | None
    retain_until: float = 0.0


class TierIndex(Generic[K]):
    """LRU accounting of one tier: which hashes it holds, their sizes and owners, bounded by `capacity` bytes.
    Not thread-safe by itself: each tier guards it with its lock."""

    def __init__(self, capacity: int) -> None:
        if capacity < 0:
            raise ValueError(f"a tier's capacity must be >= 0 bytes, got {capacity}")
        self.capacity = capacity
        self.entries: OrderedDict[K, TierEntry] = OrderedDict()  # least recently used first
        self._owned: dict[Owner, dict[K, None]] = {}
        self.total_bytes = 0
        self.num_evictions = 0

    def __len__(self) -> int:
        return len(self.entries)

    def __contains__(self, key: K) -> bool:
        return key in self.entries

    def touch(self, key: K) -> None:
        if key in self.entries:
            self.entries.move_to_end(key)

    def add(self, key: K, entry: TierEntry, now: float = 0.0) -> list[K]:
        """Record `key` (most recently used) and return the keys evicted to make room, oldest first; an entry
        larger than the whole capacity is not added (returned as evicted itself). Entries retained past `now`
        go only after every unretained one."""
        self.remove(key)
        if entry.size > self.capacity:
            return [key]
        evicted: list[K] = []
        while self.total_bytes + entry.size > self.capacity:
            victim = self._victim(now)
            self.remove(victim)
            self.num_evictions += 1
            evicted.append(victim)
        self.entries[key] = entry
        self.total_bytes += entry.size
        if entry.owner is not None:
            self._owned.setdefault(entry.owner, {})[key] = None
        return evicted

    def _victim(self, now: float) -> K:
        # The oldest unretained entry among the first few (retention is a hint: a tier that holds only
        # retained entries still evicts its oldest rather than refusing the new one).
        for i, (key, e) in enumerate(self.entries.items()):
            if e.retain_until <= now or i >= 64:
                return key
        return next(iter(self.entries))

    def remove(self, key: K) -> TierEntry | None:
        entry = self.entries.pop(key, None)
        if entry is None:
            return None
        self.total_bytes -= entry.size
        if entry.owner is not None:
            mine = self._owned[entry.owner]
            del mine[key]
            if not mine:
                del self._owned[entry.owner]
        return entry

    def forget(self, owner: Owner) -> list[K]:
        """Remove and return every key of `owner` (costs that owner's entries, not the tier's)."""
        keys = list(self._owned.get(owner, ()))
        for key in keys:
            self.remove(key)
        return keys

    def clear(self) -> list[K]:
        keys = list(self.entries)
        self.entries.clear()
        self._owned.clear()
        self.total_bytes = 0
        return keys

    def check_invariants(self) -> None:
        assert self.total_bytes == sum(e.size for e in self.entries.values()), "tier bytes drifted"
        assert self.total_bytes <= self.capacity, "tier over its capacity"
        indexed = {(o, k) for o, keys in self._owned.items() for k in keys}
        assert indexed == {(e.owner, k) for k, e in self.entries.items() if e.owner is not None}


class HostTier:
    """KV blocks in host RAM (`--kv-host-memory`): between the device pool and the disk tier on CUDA, and
    usable alone on any device. Bytes live in this process only, so no encryption: the pool itself is not."""

    name = "host"

    def __init__(self, capacity: int) -> None:
        self.index: TierIndex[BlockHash] = TierIndex(capacity)
        self._data: dict[BlockHash, bytes] = {}
        self._lock = threading.Lock()
        self.epoch = 0  # bumped by forget / clear: puts queued before them are dropped

    @property
    def enabled(self) -> bool:
        return self.index.capacity > 0

    @property
    def num_blocks(self) -> int:
        return len(self.index)

    @property
    def num_bytes(self) -> int:
        return self.index.total_bytes

    def contains(self, block_hash: BlockHash) -> bool:
        return block_hash in self.index

    def get(self, block: TierBlock) -> bytes | None:
        with self._lock:
            data = self._data.get(block.block_hash)
            if data is not None:
                self.index.touch(block.block_hash)
            return data

    def put(self, block: TierBlock, payload: bytes, epoch: int) -> None:
        with self._lock:
            if epoch != self.epoch:
                return  # a reset came after this write was queued
            entry = TierEntry(len(payload), block.owner, block.retain_until)
            for key in self.index.add(block.block_hash, entry):
                self._data.pop(key, None)
            if block.block_hash in self.index:
                self._data[block.block_hash] = payload

    def forget(self, owner: Owner) -> int:
        with self._lock:
            self.epoch += 1
            keys = self.index.forget(owner)
            for key in keys:
                del self._data[key]
            return len(keys)

    def clear(self) -> None:
        with self._lock:
            self.epoch += 1
            self.index.clear()
            self._data.clear()

    def close(self) -> None:
        self.clear()

    def check_invariants(self) -> None:
        with self._lock:
            self.index.check_invariants()
            assert set(self._data) == set(self.index.entries), "host tier data != its index"
