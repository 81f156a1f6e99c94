"""The block pool: every block's ref count and hash, the LRU free queue and the hash -> block map.

Blocks are ints `0 .. num_blocks - 1`; their state lives in parallel lists indexed by block id (cheaper than an
object per block on the scheduler's hot path). Rules the pool keeps:
- A block is in the free queue exactly when its ref count is 0. A free block may still hold a hash (its KV
  data is intact): a prefix hit can revive it (`touch`) until allocation reuses it.
- `take(n)` pops the queue's head (least recently freed) and drops the block's old hash only then.
- `free(ids)` appends blocks whose ref count drops to 0 to the tail, in the order given; the manager passes a
  request's blocks in reverse so that the deepest block of a chain is evicted first.
- One hash may be held by several blocks (two requests that computed the same prefix without sharing it);
  lookups return the first one cached.
- Tails (token-granular reuse, see `longest_tail`): a block may also be filed under a tail key
  (`BlockHasher.tail_key`) with the tokens whose KV it holds. Every cached block is filed (all its tokens), so is
  a request's last, partly filled block once the request frees it (`add_partial`: free, no hash, the tokens it
  computed). A tail entry goes when its block is taken, loses its hash, or is forgotten. Blocks cached during
  the current scheduling pass are `fresh` (their KV is written by the coming step), so no tail lookup returns
  them until `end_pass()`.
- A cached block may carry an owner (`kv_cache.namespace.Owner`: the tenant whose private namespace hashed
  it); `forget(owner)` drops the hash of every block that owner holds, in use or not (a tenant's "forget my
  prompts"). A block in use that was forgotten keeps serving its request, without a hash. An index by owner
  makes forget's cost that owner's blocks, not the pool's: any tenant may send a reset, under the core lock.
Every block returned by take() must be freed exactly once per reference taken (take or touch).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence

from kv_cache.hashing import BlockHash
from kv_cache.namespace import Owner
from kv_cache.stats import AllBlocksCleared, BlockRemoved, KVCacheEvent


class BlockPool:
    def __init__(self, num_blocks: int, events: list[KVCacheEvent] | None = None) -> None:
        """`events`: a list to append BlockRemoved / AllBlocksCleared to, or None to record none."""
        if num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {num_blocks}")
        self.num_blocks = num_blocks
        self.ref_cnt: list[int] = [0] * num_blocks
        self.block_hash: list[BlockHash | None] = [None] * num_blocks
        # Owner of each cached private block (None for public / unsalted ones and for blocks without a hash).
        self.block_owner: list[Owner | None] = [None] * num_blocks
        # The same, by owner (a dict as an ordered set): every write goes through _set_owner.
        self._owned: dict[Owner, dict[int, None]] = {}
        # Tails: each block's tail key (None: not filed) and the tokens whose KV it holds; key -> its blocks,
        # oldest filed first (a dict as an ordered set).
        self.tail_key: list[BlockHash | None] = [None] * num_blocks
        self.tail_tokens: list[tuple[int, ...]] = [()] * num_blocks
        self._tails: dict[BlockHash, dict[int, None]] = {}
        self.fresh: set[int] = set()  # cached during this scheduling pass: not computed until the step runs
        # Blocks in use whose hash forget() dropped: the manager's "leading blocks are cached" rule excuses
        # them until they are allocated again.
        self.forgotten: set[int] = set()
        # OrderedDict as an LRU queue: O(1) pop at the head, append at the tail and removal from the middle.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: dict[BlockHash, int] = {}
        # Further blocks holding a hash that is already in _cached (rare), so the common lookup stays one dict get.
        self._dups: dict[BlockHash, list[int]] = {}
        self.num_cached_blocks = 0
        self.num_evictions = 0  # cumulative; the manager turns it into per-interval stats
        self._events = events

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    def get_cached_block(self, block_hash: BlockHash) -> int | None:
        return self._cached.get(block_hash)

    def take(self, n: int) -> list[int]:
        """Allocate `n` blocks (ref count 1) from the head of the free queue. The caller checks n <= free."""
        if n > len(self._free):
            raise ValueError(f"cannot take {n} blocks: only {len(self._free)} free")
        popitem = self._free.popitem
        ids = [popitem(last=False)[0] for _ in range(n)]
        ref_cnt = self.ref_cnt
        block_hash = self.block_hash
        removed: list[BlockHash] = []
        tail_key = self.tail_key
        for b in ids:
            ref_cnt[b] = 1
            if block_hash[b] is not None:
                self._evict(b, removed)
            elif tail_key[b] is not None:  # a partial block's KV is about to be overwritten
                self._drop_tail(b)
                self._set_owner(b, None)
        if removed and self._events is not None:
            self._events.append(BlockRemoved(removed))
        return ids

    def _evict(self, b: int, removed: list[BlockHash]) -> None:
        self.num_evictions += 1
        self._drop_hash(b, removed)

    def _drop_hash(self, b: int, removed: list[BlockHash]) -> None:
        """Forget block b's hash; a hash no other block holds is appended to `removed` (for the event)."""
        h = self.block_hash[b]
        assert h is not None
        self.block_hash[b] = None
        self._drop_tail(b)
        self._set_owner(b, None)
        self.num_cached_blocks -= 1
        dups = self._dups.get(h)
        if self._cached[h] == b:
            if dups:
                self._cached[h] = dups.pop(0)
            else:
                del self._cached[h]
                removed.append(h)
        else:
            assert dups is not None
            dups.remove(b)
        if dups is not None and not dups:
            del self._dups[h]

    def touch(self, ids: Iterable[int]) -> None:
        """Take one more reference to each block, reviving free ones (out of the free queue)."""
        ref_cnt = self.ref_cnt
        free = self._free
        for b in ids:
            if ref_cnt[b] == 0:
                del free[b]
            ref_cnt[b] += 1

    def free(self, ids: Iterable[int]) -> None:
        """Drop one reference to each block; blocks reaching 0 go to the queue's tail in the order given."""
        ref_cnt = self.ref_cnt
        free = self._free
        for b in ids:
            ref_cnt[b] -= 1
            if ref_cnt[b] == 0:
                free[b] = None
                if self.forgotten:
                    self.forgotten.discard(b)

    def cache(
        self,
        ids: Sequence[int],
        hashes: Sequence[BlockHash],
        owners: Sequence[Owner | None] | None = None,
        tails: Sequence[tuple[BlockHash, tuple[int, ...]]] | None = None,
    ) -> None:
        """Give each block (in use, holding no hash) its hash and make it findable; `owners`: each block's
        owner (default: none); `tails`: each block's (tail key, tokens), to file it for tail lookups too (it
        is `fresh` until end_pass())."""
        block_hash = self.block_hash
        cached = self._cached
        if owners is not None:
            for b, owner in zip(ids, owners, strict=True):
                self._set_owner(b, owner)
        for b, h in zip(ids, hashes, strict=True):
            block_hash[b] = h
            if h in cached:
                self._dups.setdefault(h, []).append(b)
            else:
                cached[h] = b
        self.num_cached_blocks += len(ids)
        if tails is not None:
            for b, (key, tokens) in zip(ids, tails, strict=True):
                self._file_tail(b, key, tokens)
            self.fresh.update(ids)

    def add_partial(self, b: int, key: BlockHash, tokens: tuple[int, ...], owner: Owner | None) -> None:
        """File a free block without a hash (a request's last, partly filled block, just freed) under `key`,
        holding the KV of `tokens` (fewer than a block's worth), for tail lookups until it is taken."""
        if self.ref_cnt[b] or self.block_hash[b] is not None:
            raise ValueError(f"block {b} is in use or cached: only a free block without a hash is a partial")
        self._file_tail(b, key, tokens)
        self._set_owner(b, owner)

    def _set_owner(self, b: int, owner: Owner | None) -> None:
        old = self.block_owner[b]
        if old == owner:
            return
        if old is not None:
            mine = self._owned[old]
            del mine[b]
            if not mine:
                del self._owned[old]
        if owner is not None:
            self._owned.setdefault(owner, {})[b] = None
        self.block_owner[b] = owner

    def _file_tail(self, b: int, key: BlockHash, tokens: tuple[int, ...]) -> None:
        if self.tail_key[b] is not None:
            self._drop_tail(b)
        self.tail_key[b] = key
        self.tail_tokens[b] = tokens
        self._tails.setdefault(key, {})[b] = None

    def _drop_tail(self, b: int) -> None:
        key = self.tail_key[b]
        if key is None:
            return
        self.tail_key[b] = None
        self.tail_tokens[b] = ()
        self.fresh.discard(b)
        blocks = self._tails[key]
        del blocks[b]
        if not blocks:
            del self._tails[key]

    def longest_tail(
        self, key: BlockHash, tokens: Sequence[int], scan: int = 32, in_flight: Collection[int] = ()
    ) -> tuple[int, int]:
        """(block, n): a block filed under `key` whose KV holds the first n of `tokens`, the largest n among the
        `scan` most recently filed blocks that are neither fresh nor `in_flight` (blocks a step still being
        computed writes); (-1, 0) when none shares even the first token. Bounded, since a popular prefix may
        have thousands of continuations: the newest are the likeliest to be the same conversation again."""
        blocks = self._tails.get(key)
        if not blocks or not tokens:
            return -1, 0
        best, best_n = -1, 0
        fresh = self.fresh
        first = tokens[0]
        for i, b in enumerate(reversed(blocks)):
            if i == scan:
                break
            held = self.tail_tokens[b]
            if not held or held[0] != first or b in fresh or b in in_flight:
                continue
            n = 1
            for x, y in zip(held[1:], tokens[1:], strict=False):  # the shorter one bounds the run
                if x != y:
                    break
                n += 1
            if n > best_n:
                best, best_n = b, n
                if n == len(tokens):
                    break
        return best, best_n

    def end_pass(self) -> frozenset[int]:
        """The scheduling pass is over: the blocks it cached are computed by the step that follows it, before
        any later pass can look them up, except a pass made while that step runs (the engine's express passes),
        which must skip the blocks returned here."""
        cached = frozenset(self.fresh)
        self.fresh.clear()
        return cached

    def reset(self, force: bool = False) -> bool:
        """Drop every hash; refused (False, nothing changed) while any block is in use, unless `force`: then
        blocks in use lose their hash too and keep serving their requests (as forget() leaves them)."""
        if len(self._free) != self.num_blocks:
            if not force:
                return False
            ref_cnt, block_hash = self.ref_cnt, self.block_hash
            in_use = [b for b in range(self.num_blocks) if ref_cnt[b]]
            forgotten = {b for b in in_use if block_hash[b] is not None or b in self.forgotten}
        else:
            forgotten = set()
        self.block_hash[:] = [None] * self.num_blocks  # in place: callers may hold the list
        self.block_owner[:] = [None] * self.num_blocks
        self._owned.clear()
        self.tail_key[:] = [None] * self.num_blocks
        self.tail_tokens[:] = [()] * self.num_blocks
        self._tails.clear()
        self.fresh.clear()
        self.forgotten = forgotten
        self._cached.clear()
        self._dups.clear()
        self.num_cached_blocks = 0
        if self._events is not None:
            self._events.append(AllBlocksCleared())
        return True

    def forget(self, owner: Owner) -> int:
        """Drop the hash of every block `owner` holds, in use or free; returns how many. Not evictions: the
        blocks are not reallocated (free ones stay where they are in the queue, now without a hash). Costs
        the owner's blocks only (the index), whatever the pool's size."""
        removed: list[BlockHash] = []
        n = 0
        for b in list(self._owned.get(owner, ())):
            if self.block_hash[b] is not None:
                self._drop_hash(b, removed)
                if self.ref_cnt[b]:
                    self.forgotten.add(b)
            else:  # a partial block (free, filed for tail lookups only)
                self._drop_tail(b)
                self._set_owner(b, None)
            n += 1
        if removed and self._events is not None:
            self._events.append(BlockRemoved(removed))
        return n

    def check_invariants(self, held: Iterable[Sequence[int]]) -> None:
        """Raise AssertionError unless ref counts equal the references in `held` (every request's block
        table), the free queue holds exactly the unreferenced blocks, and the hash map matches the hashes."""
        n = self.num_blocks
        expected = [0] * n
        for ids in held:
            assert len(set(ids)) == len(ids), f"a block table lists a block twice: {ids}"
            for b in ids:
                expected[b] += 1
        assert len(self.ref_cnt) == n and len(self.block_hash) == n
        assert self.ref_cnt == expected, f"ref counts {self.ref_cnt} != references held {expected}"
        free = list(self._free)
        assert sorted(free) == [b for b in range(n) if expected[b] == 0], "free queue != unreferenced blocks"
        holders: dict[BlockHash, list[int]] = {}
        for b, h in enumerate(self.block_hash):
            if h is not None:
                holders.setdefault(h, []).append(b)
        assert self.num_cached_blocks == sum(map(len, holders.values())), "num_cached_blocks is off"
        assert set(self._cached) == set(holders), "hash map keys != hashes held by blocks"
        for h, bs in holders.items():
            mapped = [self._cached[h], *self._dups.get(h, [])]
            assert sorted(mapped) == bs, f"hash map lists {mapped} for a hash held by blocks {bs}"
        assert set(self._dups) <= set(self._cached) and all(self._dups.values()), "stale duplicate entries"
        for b, owner in enumerate(self.block_owner):
            assert owner is None or self.block_hash[b] is not None or self.tail_key[b] is not None, (
                f"block {b} has an owner but is neither cached nor a partial"
            )
        indexed = {(o, b) for o, blocks in self._owned.items() for b in blocks}
        assert indexed == {(o, b) for b, o in enumerate(self.block_owner) if o is not None}, (
            "the owner index != the blocks' owners"
        )
        assert all(self._owned.values()), "an owner with no blocks is still indexed"
        filed = {b for blocks in self._tails.values() for b in blocks}
        assert filed == {b for b in range(n) if self.tail_key[b] is not None}, "tail map != filed blocks"
        for key, blocks in self._tails.items():
            assert blocks and all(self.tail_key[b] == key for b in blocks), (
                f"blocks filed under a wrong key: {blocks}"
            )
        for b in filed:
            assert 0 < len(self.tail_tokens[b]), f"block {b} is filed with no tokens"
            assert self.block_hash[b] is not None or expected[b] == 0, f"partial block {b} is in use"
        assert self.fresh <= filed, "a fresh block is not filed"
        for b in self.forgotten:
            assert self.block_hash[b] is None and expected[b] > 0, f"forgotten block {b} is cached or free"
