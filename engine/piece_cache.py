"""Token ids of recently encoded prompt pieces, so that a prompt repeating an earlier one's text (a shared
system prompt, one document and many questions, a chat's earlier turns) is tokenized only where it is new.

Why: tokenizing is the one part of a warm request whose cost grew with its cached tokens, where the KV cache
makes everything else grow with the new ones: 1.2 ms of an 11 KB, 2,000-token document on a 2-core EPYC, ~11
ms at 20,000 tokens, every time the document is sent. The pieces are cut where `engine.split_encode` proves
that pieces encode to exactly the tokens of the whole (`split_for_reuse`: content-defined cuts, so a text
that starts like an earlier one is cut the same way there), so a reused piece gives the same tokens a fresh
encoding would: reuse changes only speed.

Tenancy: an entry is kept per cache namespace (`kv_cache.namespace.CacheNamespace`), like a KV block, so a
tenant can never time whether another tenant sent a text. A reset of the prefix cache forgets the pieces of
the namespaces it resets (`forget`).

Bounded by the characters it holds (least recently used first out); thread-safe (the server tokenizes in
worker threads). Entries are indexed by their namespace's owner, as the KV block pool's are, so a tenant's
reset costs that tenant's entries, never a scan of everyone's under the lock every tokenization waits for.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict
from collections.abc import Sequence

from engine.owner_index import OwnerIndex
from kv_cache.namespace import CacheNamespace, Owner

MAX_CHARS = 8_000_000  # ~8 MB of text and ~2 MB of ids: a few hundred long documents

_Key = tuple[CacheNamespace | None, str]


class PieceCache:
    def __init__(self, max_chars: int = MAX_CHARS) -> None:
        self.max_chars = max_chars
        self._entries: OrderedDict[_Key, array] = OrderedDict()
        self._owned: OwnerIndex[_Key] = OwnerIndex()
        self._chars = 0
        self._lock = threading.Lock()
        self.hits = 0  # pieces found, and not found, since start: for tests and benchmarks
        self.misses = 0

    def __len__(self) -> int:
        return len(self._entries)

    @property
    def chars(self) -> int:
        return self._chars

    def lookup(self, namespace: CacheNamespace | None, pieces: Sequence[str]) -> list[array | None]:
        """Each piece's token ids as stored for this namespace, or None."""
        out: list[array | None] = []
        with self._lock:
            for piece in pieces:
                ids = self._entries.get((namespace, piece))
                if ids is not None:
                    self._entries.move_to_end((namespace, piece))
                out.append(ids)
            found = sum(ids is not None for ids in out)
            self.hits += found
            self.misses += len(out) - found
        return out

    def store(self, namespace: CacheNamespace | None, pieces: Sequence[str], ids: Sequence[array]) -> None:
        """Keeps each piece's ids for this namespace, dropping the least recently used beyond `max_chars`."""
        with self._lock:
            for piece, piece_ids in zip(pieces, ids, strict=True):
                if len(piece) > self.max_chars:
                    continue
                key = (namespace, piece)
                if key not in self._entries:
                    self._chars += len(piece)
                    self._owned.add(key)
                self._entries[key] = piece_ids
                self._entries.move_to_end(key)
            while self._chars > self.max_chars:
                old, _ = self._entries.popitem(last=False)
                self._chars -= len(old[1])
                self._owned.discard(old)

    def forget(self, owner: Owner | None = None) -> None:
        """Forgets every piece (None), or those of the namespaces `owner` owns (a tenant-scoped reset)."""
        with self._lock:
            if owner is None:
                self._entries.clear()
                self._owned.clear()
                self._chars = 0
                return
            for key in self._owned.pop(owner):
                del self._entries[key]
                self._chars -= len(key[1])

    def check_invariants(self) -> None:
        """Tests call this: the owner index holds exactly the owned entries, and the count of characters."""
        with self._lock:
            self._owned.check(self._entries)
            assert self._chars == sum(len(k[1]) for k in self._entries), "character count out of step"
