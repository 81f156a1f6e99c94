"""Retention: blocks a client asked to keep (OpenAI `prompt_cache_retention`, Anthropic `cache_control` ttl)
stay in the pool for their TTL instead of being evicted, each hit refreshing it.

A retained block holds one reference of its own (so the free queue never sees it and allocation never takes
it), released when its TTL passes, when its hash is dropped (a reset, a tenant's reset), or when it yields
to the caps:
- a global cap, `max_blocks` (`--max-retained-fraction` of the pool);
- a per-holder share, the cap over the holders of retained blocks: a holder at its share that retains one
  more block releases one of its own; when the whole cap is taken, the holder with the most yields one. Alone,
  a holder may use the whole cap; no holder can pin the pool.
A holder is whoever a share is counted for (`CacheNamespace.holder`: the tenant, else the gateway's value,
else the salt), so a tenant's salts and adapters do not multiply its share. Never logged, never exported.

What yields first: the deepest block of the holder's least recently used prompt. A prompt's blocks are only
reachable from its first one on (each block's hash chains its parent's), so releasing a prompt's first block
kept the rest pinned for nothing (a probe: a retained 41-block prompt got 0 tokens cached after one block of
it yielded, and its 40 others stayed retained for their TTL). Each retained or hit prompt's blocks therefore
move to the back in reverse order (its deepest block before its first), and a prompt that does not fit keeps
its leading blocks: the one that found no room and those after it are not retained.

Rule a caller keeps: every reference `retain` takes is released exactly once, by this table.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from kv_cache.block_pool import BlockPool


@dataclass(slots=True)
class _Held:
    holder: Hashable
    expires: float  # monotonic seconds
    ttl: float  # how long a hit keeps it from now


class RetentionTable:
    def __init__(self, pool: BlockPool, max_blocks: int) -> None:
        self.pool = pool
        self.max_blocks = max(0, max_blocks)
        self._held: dict[int, _Held] = {}
        self._by_ns: dict[Hashable, OrderedDict[int, None]] = {}  # per holder, in the order they yield
        self._next_expiry = float("inf")
        self.num_expiries = 0  # cumulative: TTLs that ran out
        self.num_yielded = 0  # cumulative: released early for a cap

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, block: int) -> bool:
        return block in self._held

    def retain(self, chain: Sequence[int], holder: Hashable, ttl: float, now: float) -> None:
        """Keep a prompt's leading blocks `chain` (cached, in use by the caller, in the prompt's order) until
        now + ttl; those already retained are refreshed. None of them yields to make room for another."""
        if self.max_blocks == 0 or ttl <= 0:
            return
        expires = now + ttl
        protected = set(chain)
        kept: list[int] = []
        for b in chain:
            held = self._held.get(b)
            if held is None:
                if not self._make_room(holder, protected):
                    break  # the blocks after it are unreachable without it
                self.pool.touch((b,))
                self._held[b] = _Held(holder, expires, ttl)
                self._by_ns.setdefault(holder, OrderedDict())[b] = None
                self._next_expiry = min(self._next_expiry, expires)
            else:
                held.expires = max(held.expires, expires)
                held.ttl = max(held.ttl, ttl)
            kept.append(b)
        self._to_back(kept)

    def _make_room(self, holder: Hashable, protected: set[int]) -> bool:
        mine = self._by_ns.get(holder)
        holders = len(self._by_ns) + (0 if mine else 1)
        share = max(1, self.max_blocks // holders)
        if mine is not None and len(mine) >= share:
            return self._yield_from(mine, protected)  # past its share: one of its own yields
        if len(self._held) >= self.max_blocks:
            # (not this holder's: under its share while the cap is taken, another holds more than a share)
            return self._yield_from(max(self._by_ns.values(), key=len), protected)
        return True

    def _yield_from(self, blocks: OrderedDict[int, None], protected: set[int]) -> bool:
        victim = next((b for b in blocks if b not in protected), None)
        if victim is None:
            return False  # all of it is the prompt being retained
        self._release(victim)
        self.num_yielded += 1
        return True

    def _to_back(self, chain: list[int]) -> None:
        """The prompt `chain` was just used: its blocks yield last, and its deepest before its first."""
        for b in reversed(chain):
            self._by_ns[self._held[b].holder].move_to_end(b)

    def refresh(self, blocks: Iterable[int], now: float) -> None:
        """A hit on a prompt's leading blocks (in order): each retained one's TTL starts again (by its own
        length)."""
        hit = [b for b in blocks if b in self._held]
        for b in hit:
            held = self._held[b]
            held.expires = max(held.expires, now + held.ttl)
        self._to_back(hit)

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
        """Release up to `n` retained blocks (the largest holder's, in the order they yield) for an admission
        that could not happen otherwise; True if any was released."""
        released = 0
        while released < n and self._held:
            self._yield_from(max(self._by_ns.values(), key=len), set())
            released += 1
        return released > 0

    def release_all(self) -> None:
        for b in list(self._held):
            self._release(b)

    def _release(self, b: int) -> None:
        held = self._held.pop(b)
        mine = self._by_ns[held.holder]
        del mine[b]
        if not mine:
            del self._by_ns[held.holder]
        self.pool.free((b,))

    def held(self) -> list[list[int]]:
        """One list per retained block (its reference), for check_invariants."""
        return [[b] for b in self._held]

    def count(self, holder: Hashable) -> int:
        return len(self._by_ns.get(holder, ()))
