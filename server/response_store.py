"""Stored responses of `POST /v1/responses` (`store: true`, OpenAI's default): in memory, bounded, expiring, and
readable only from the cache namespace that made them.

Each entry keeps the response object as it was returned (for `GET /v1/responses/{id}`) and the conversation
items that led to it, its own output included, so that `previous_response_id` can continue it without
walking a chain whose older links may have been evicted.

Rules kept here:
- an entry is visible only to a lookup with the namespace it was stored under (tenant, gateway header and
  `cache_salt` all equal): any other namespace, a missing id, an expired or an evicted entry look the same
  (None), so a caller learns nothing about responses that are not its own;
- at most `max_entries` entries and `max_bytes` of their JSON in all; past either, the holder storing the most
  of it (`CacheNamespace.holder`: the tenant, else the gateway's value, else the salt) loses its oldest entry,
  so a tenant that floods the store evicts its own responses, never another's while it holds more (a probe's
  10,000 requests from one tenant evicted another tenant's stored response when the oldest went first); an
  entry larger than `max_bytes` alone is not kept;
- an entry older than `ttl_s` seconds is gone (checked on access and on every store).
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any

from kv_cache.namespace import CacheNamespace


@dataclass(slots=True)
class StoreLimits:
    max_entries: int = 10_000
    max_bytes: int = 256 * 1024 * 1024
    ttl_s: float = 3600.0


@dataclass(slots=True)
class StoredResponse:
    namespace: CacheNamespace | None
    response: dict[str, Any]  # the response object, as returned
    items: list[dict[str, Any]]  # the conversation so far: input items, then this response's output items
    stored_at: float
    size: int  # bytes of JSON, for the bound


@dataclass(slots=True)
class _Holder:
    """One holder's entries, oldest first, and their bytes."""

    ids: OrderedDict[str, None] = field(default_factory=OrderedDict)
    bytes: int = 0


def _holder(namespace: CacheNamespace | None) -> Hashable:
    return (namespace or CacheNamespace()).holder


class ResponseStore:
    """Thread-safe (routes run on the event loop, tests may call it from anywhere)."""

    def __init__(
        self, limits: StoreLimits | None = None, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.limits = limits or StoreLimits()
        self._clock = clock
        self._entries: OrderedDict[str, StoredResponse] = OrderedDict()
        self._bytes = 0
        self._holders: dict[Hashable, _Holder] = {}
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._expire(self._clock())
            return len(self._entries)

    @property
    def num_bytes(self) -> int:
        return self._bytes

    def put(
        self,
        response_id: str,
        namespace: CacheNamespace | None,
        response: dict[str, Any],
        items: list[dict[str, Any]],
    ) -> bool:
        """Keep a response; False when it is not kept (larger than the bound alone, or its own holder's
        oldest once the bound is made)."""
        size = len(json.dumps(response, ensure_ascii=False)) + len(json.dumps(items, ensure_ascii=False))
        if size > self.limits.max_bytes or self.limits.max_entries < 1:
            return False
        with self._lock:
            now = self._clock()
            self._expire(now)
            self._drop(response_id)
            self._entries[response_id] = StoredResponse(namespace, response, items, now, size)
            self._bytes += size
            holder = self._holders.setdefault(_holder(namespace), _Holder())
            holder.ids[response_id] = None
            holder.bytes += size
            while len(self._entries) > self.limits.max_entries:
                self._drop(self._oldest_of(lambda h: len(h.ids)))
            while self._bytes > self.limits.max_bytes:
                self._drop(self._oldest_of(lambda h: h.bytes))
            return response_id in self._entries

    def _oldest_of(self, measure: Callable[[_Holder], int]) -> str:
        """The oldest entry of the holder with the most by `measure`."""
        return next(iter(max(self._holders.values(), key=measure).ids))

    def get(self, response_id: str, namespace: CacheNamespace | None) -> StoredResponse | None:
        """The entry, if it exists and belongs to `namespace`."""
        with self._lock:
            return self._visible(response_id, namespace)

    def delete(self, response_id: str, namespace: CacheNamespace | None) -> bool:
        """Forget the entry; False when `namespace` could not see it (nothing is deleted then)."""
        with self._lock:
            if self._visible(response_id, namespace) is None:
                return False
            self._drop(response_id)
            return True

    def clear(self) -> None:
        with self._lock:
            self._entries.clear()
            self._bytes = 0
            self._holders.clear()

    def _visible(self, response_id: str, namespace: CacheNamespace | None) -> StoredResponse | None:
        self._expire(self._clock())
        entry = self._entries.get(response_id)
        if entry is None or entry.namespace != namespace:
            return None
        return entry

    def _expire(self, now: float) -> None:
        # Entries are kept in the order they were stored, so the expired ones are at the front.
        cutoff = now - self.limits.ttl_s
        while self._entries:
            key, entry = next(iter(self._entries.items()))
            if entry.stored_at >= cutoff:
                return
            self._drop(key)

    def _drop(self, response_id: str) -> None:
        entry = self._entries.pop(response_id, None)
        if entry is not None:
            self._bytes -= entry.size
            key = _holder(entry.namespace)
            holder = self._holders[key]
            del holder.ids[response_id]
            holder.bytes -= entry.size
            if not holder.ids:
                del self._holders[key]
