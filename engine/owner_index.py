"""Which keys of a namespaced cache each owner holds, so that a tenant's reset costs that tenant's entries,
never a scan of everyone's under the cache's lock (as the KV block pool's owner index does).

The caches that use it (`engine.piece_cache`, `engine.structured_output`) key their entries by tuples whose
first element is the entry's `CacheNamespace` (None: the unsalted namespace, which no owner holds). Not
thread-safe on its own: each cache calls it under its own lock.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Generic, TypeVar

from kv_cache.namespace import Owner

K = TypeVar("K", bound=tuple)


class OwnerIndex(Generic[K]):
    def __init__(self) -> None:
        self._owned: dict[Owner, dict[K, None]] = {}  # owner -> its keys (an insertion-ordered set)

    @staticmethod
    def _owner(key: K) -> Owner | None:
        return key[0].owner if key[0] is not None else None

    def add(self, key: K) -> None:
        owner = self._owner(key)
        if owner is not None:
            self._owned.setdefault(owner, {})[key] = None

    def discard(self, key: K) -> None:
        """Drops an evicted key (one whose namespace no owner holds is not indexed)."""
        owner = self._owner(key)
        if owner is None:
            return
        mine = self._owned[owner]
        del mine[key]
        if not mine:  # an owner with no keys is not kept: the index never outgrows the cache
            del self._owned[owner]

    def pop(self, owner: Owner) -> list[K]:
        """The owner's keys, forgotten here: the caller drops the entries."""
        return list(self._owned.pop(owner, {}))

    def clear(self) -> None:
        self._owned.clear()

    def check(self, keys: Iterable[K]) -> None:
        """Tests call this (through the cache's check_invariants): the index holds exactly the owned keys."""
        owned = {k for k in keys if self._owner(k) is not None}
        assert owned == {k for mine in self._owned.values() for k in mine}, "owner index out of step"
        assert all(self._owned.values()), "an owner with no entries is still indexed"
