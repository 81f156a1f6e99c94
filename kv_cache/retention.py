"""Retention: blocks a client asked to keep (OpenAI `prompt_cache_retention`, Anthropic `cache_control` ttl)
stay in the pool for their TTL instead of being evicted, each hit refreshing it.

A retained block holds one reference of its own (so the free queue never sees it and allocation never takes
it), released when its TTL passes, when its hash is dropped (a reset, a tenant's reset), or when it yields
to the caps:
- a global cap, `max_blocks` (`--max-retained-fraction` of the pool);
- a per-namespace share, the cap over the namespaces holding retained blocks: a namespace at its share that
  retains one more block releases its own oldest; when the whole cap is taken, the namespace holding the
  most yields its oldest. Alone, a namespace may use the whole cap; no namespace can pin the pool.
Namespaces here are `CacheNamespace` values (never logged, never exported).

Rule a caller keeps: every reference `retain` takes is released exactly once, by this table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable
from dataclasses import dataclass

from kv_cache.block_pool import BlockPool


@dataclass(slots=True)
class _Held:
    namespace: Hashable
    expires: float  # monotonic seconds
    ttl: float  # how long a hit keeps it from now


class RetentionTable:
    def __init__(self, pool: BlockPool, max_blocks: int) -> None:
        self.pool = pool
        self.max_blocks = max(0, max_blocks)
        self._held: dict[int, _Held] = {}
        self._by_ns: dict[Hashable, OrderedDict[int, None]] = {}  # oldest retained first
        self._next_expiry = float("inf")
        self.num_expiries = 0  # cumulative: TTLs that ran out
        self.num_yielded = 0  # cumulative: released early for a cap

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, block: int) -> bool:
        return block in self._held

    def retain(self, blocks: Iterable[int], namespace: Hashable, ttl: float, now: float) -> None:
        """Keep `blocks` (cached, in use by the caller) until now + ttl; already retained ones are refreshed."""
        if self.max_blocks == 0 or ttl <= 0:
            return
        expires = now + ttl
        for b in blocks:
            held = self._held.get(b)
            if held is not None:
                held.expires = max(held.expires, expires)
                held.ttl = max(held.ttl, ttl)
                self._by_ns[held.namespace].move_to_end(b)
                continue
            if not self._make_room(namespace):
                continue
            self.pool.touch((b,))
            self._held[b] = _Held(namespace, expires, ttl)
            self._by_ns.setdefault(namespace, OrderedDict())[b] = None
            self._next_expiry = min(self._next_expiry, expires)

    def _make_room(self, namespace: Hashable) -> bool:
        mine = self._by_ns.get(namespace)
        holders = len(self._by_ns) + (0 if mine else 1)
        share = max(1, self.max_blocks // holders)
        if mine is not None and len(mine) >= share:
            self._release(next(iter(mine)))  # past its share: its own oldest yields
            self.num_yielded += 1
            return True
        if len(self._held) >= self.max_blocks:
            biggest = max(self._by_ns.values(), key=len)
            if mine is not None and biggest is mine:
                return False  # cannot happen after the share check; kept safe
            self._release(next(iter(biggest)))
            self.num_yielded += 1
        return True

    def refresh(self, blocks: Iterable[int], now: float) -> None:
        """A hit on retained blocks: each one's TTL starts again (by its own length)."""
        for b in blocks:
            held = self._held.get(b)
            if held is not None:
                held.expires = max(held.expires, now + held.ttl)
                self._by_ns[held.namespace].move_to_end(b)

    def expire(self, now: float) -> int:
        """Release every block whose TTL has passed; returns how many. Costs nothing until the earliest
        expiry is due."""
        if now < self._next_expiry:
            return 0
        gone = [b for b, h in self._held.items() if h.expires <= now]
        for b in gone:
            self._release(b)
        self.num_expiries += len(gone)
        self._next_expiry = min((h.expires for h in self._held.values()), default=float("inf"))
        return len(gone)

    def release_unhashed(self) -> int:
        """Release retained blocks whose hash was dropped (forget, forced reset): nothing can hit them."""
        gone = [b for b in self._held if self.pool.block_hash[b] is None]
        for b in gone:
            self._release(b)
        return len(gone)

    def yield_blocks(self, n: int) -> bool:
        """Release up to `n` retained blocks (the largest holder's oldest first) for an admission that could
        not happen otherwise; True if any was released."""
        released = 0
        while released < n and self._held:
            biggest = max(self._by_ns.values(), key=len)
            self._release(next(iter(biggest)))
            self.num_yielded += 1
            released += 1
        return released > 0

    def release_all(self) -> None:
        for b in list(self._held):
            self._release(b)

    def _release(self, b: int) -> None:
        held = self._held.pop(b)
        mine = self._by_ns[held.namespace]
        del mine[b]
        if not mine:
            del self._by_ns[held.namespace]
        self.pool.free((b,))

    def held(self) -> list[list[int]]:
        """One list per retained block (its reference), for check_invariants."""
        return [[b] for b in self._held]

    def count(self, namespace: Hashable) -> int:
        return len(self._by_ns.get(namespace, ()))
