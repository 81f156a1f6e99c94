"""TierBridge: the KV cache manager's side of the tiers behind its pool (`kv_cache.tiers`): which blocks a
lookup may load instead of recomputing, the blocks a loading request holds, and the pins that keep a block
from being reallocated until its KV has been copied out for the tiers.

Rules (the manager and the engine keep them):
- A request whose lookup hits a tier (`ComputedBlocks.load`) is given to `start_load`, never to
  `allocate_slots`: it takes references to its pool hits and fresh blocks for the tier's, and leaves the
  scheduler's queues until `finish_loads` reports it. Then the blocks that arrived are cached under their
  hashes and every block is freed (the next lookup hits them in the pool); so the request is scheduled as any
  prefix hit, and tokens it loaded count as cached, attributed to their tier (`take_tier_hits`).
- A request that finishes while loading keeps its blocks until the load is over (the loader may be writing
  into them): then they are freed uncached.
- Every block the pool caches is pinned (one reference) and queued for writing (`take_writes` after the step
  that computes it) unless every tier already holds it; `unpin` drops the pin once its KV is copied out.
"""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from kv_cache.block_pool import BlockPool
from kv_cache.lookup import CacheRequest, ComputedBlocks
from kv_cache.tiers import LoadPlan, NamespaceKeys, TierBlock, TierLookup

if TYPE_CHECKING:
    from kv_cache.hashing import BlockHasher


def block_namespace(hasher: BlockHasher, index: int) -> NamespaceKeys:
    """The namespace block `index` is encrypted under: none for a public-prefix block."""
    return () if index < hasher.num_public_blocks else hasher.namespace.keys()


class TierBridge:
    def __init__(self, pool: BlockPool, tiers: TierLookup, block_size: int) -> None:
        self.pool = pool
        self.pool_block_size = block_size
        self.tiers = tiers
        self.loading: dict[str, tuple[CacheRequest, LoadPlan]] = {}
        self._plans: list[LoadPlan] = []  # started this pass, for take_loads
        self._loaded: dict[str, tuple[int, list[str]]] = {}  # rid -> (first block, tier of each loaded)
        self._writes: list[tuple[str, TierBlock]] = []
        self.pins: Counter[int] = Counter()
        self.epoch = 0  # resets and forgets so far: a load started before one must not bring blocks back

    # ---- loads -----------------------------------------------------------------------------------------

    def find(self, hashes: Sequence[bytes]) -> list[str]:
        return self.tiers.find(hashes) if hashes else []

    def start_load(self, request: CacheRequest, computed: ComputedBlocks, table: list[int]) -> bool:
        """Reserve the hit blocks and fresh ones for the loads into `table` (the request's, empty); False
        (nothing changed) when the free queue cannot give them."""
        pool = self.pool
        hit = computed.block_ids
        revived = sum(1 for b in hit if pool.ref_cnt[b] == 0)
        n = len(computed.load)
        if n + revived > pool.num_free_blocks:
            return False
        pool.touch(hit)
        new = pool.take(n)
        table += hit + new
        hasher = request.hasher
        assert hasher is not None  # a tier lookup happens only with caching on
        owner = hasher.namespace.owner
        first = len(hit)
        blocks = [
            TierBlock(
                b,
                request.block_hashes[first + i],
                block_namespace(hasher, first + i),
                owner if first + i >= hasher.num_public_blocks else None,
            )
            for i, b in enumerate(new)
        ]
        plan = LoadPlan(request.request_id, blocks, list(computed.load), epoch=self.epoch)
        self.loading[request.request_id] = (request, plan)
        self._plans.append(plan)
        return True

    def take_loads(self) -> list[LoadPlan]:
        plans, self._plans = self._plans, []
        return plans

    def abandon(self, request_id: str) -> bool:
        """The request finished while loading: True (its blocks stay until the load is over)."""
        entry = self.loading.get(request_id)
        if entry is None:
            return False
        entry[1].abandoned = True
        return True

    def loaded(self, request_id: str, plan: LoadPlan, num_arrived: int, first: int) -> None:
        if num_arrived:
            self._loaded[request_id] = (first, plan.tiers[:num_arrived])

    def take_tier_hits(self, request_id: str, num_hit_blocks: int, block_size: int) -> dict[str, int]:
        """Of a request's hit (its first `num_hit_blocks` blocks), the tokens its last load brought, by tier."""
        entry = self._loaded.pop(request_id, None)
        out: dict[str, int] = {}
        if entry is None:
            return out
        first, tiers = entry
        for i, name in enumerate(tiers):
            if first + i < num_hit_blocks:
                out[name] = out.get(name, 0) + block_size
        return out

    def drop(self, request_id: str) -> None:
        self._loaded.pop(request_id, None)

    # ---- writes ----------------------------------------------------------------------------------------

    def note_cached(self, request: CacheRequest, blocks: Sequence[int], start: int, end: int) -> None:
        """Blocks start..end of the request were just cached: pin and queue those some tier lacks (those the
        request retains carry their retention's end, wall-clock, for the disk's LRU)."""
        wanted = getattr(request, "retention", None)
        retain_blocks = wanted[1] // self.pool_block_size if wanted else 0
        retain_until = time.time() + wanted[0] if wanted else 0.0
        hasher = request.hasher
        assert hasher is not None
        hashes = request.block_hashes
        owner = hasher.namespace.owner
        contains = self.tiers.contains
        for i in range(start, end):
            if contains(hashes[i]):
                continue
            b = blocks[i]
            self.pool.touch((b,))
            self.pins[b] += 1
            block_owner = owner if i >= hasher.num_public_blocks else None
            ns = block_namespace(hasher, i)
            until = retain_until if i < retain_blocks else 0.0
            self._writes.append((request.request_id, TierBlock(b, hashes[i], ns, block_owner, until)))

    def take_writes(self, failed: Iterable[str] = ()) -> list[TierBlock]:
        """The blocks cached since the last call, to copy out now that the step computing them ran; those of
        `failed` requests (their step did not compute them) are unpinned instead."""
        writes, self._writes = self._writes, []
        bad = set(failed)
        if bad:
            self.unpin([tb.block_id for rid, tb in writes if rid in bad])
        return [tb for rid, tb in writes if rid not in bad]

    def unpin(self, ids: Iterable[int]) -> None:
        ids = list(ids)
        for b in ids:
            self.pins[b] -= 1
            if not self.pins[b]:
                del self.pins[b]
        self.pool.free(reversed(ids))

    @property
    def busy(self) -> bool:
        return bool(self.loading or self.pins or self._writes)

    def held(self) -> list[list[int]]:
        """One list per pin, for check_invariants (the loading requests' tables are the manager's)."""
        return [[b] for b, n in self.pins.items() for _ in range(n)]
