"""KVCacheManager: the scheduler's view of the KV cache (which blocks each request holds, prefix hits,
allocation, freeing, stats, events). Pure Python accounting over a BlockPool; it never touches a tensor.

Rules a caller keeps:
- A request is looked up with get_computed_blocks() when it is (re)scheduled from waiting, and the result is
  passed to the very next allocate_slots() for that request, with no other allocation in between (the hit
  blocks take no reference until then, so another allocation could reuse them).
- Hit blocks are only given to a request that holds no blocks and has computed nothing (a new request, or one
  whose blocks were freed on preemption).
- Every request that got blocks is freed exactly once with free() (finished, aborted or preempted).
- request.block_hashes is kept current by the request's BlockHasher (make_hasher) as tokens are appended.
- A scheduling pass ends with end_pass(), before the step it planned runs: it hands over the block copies that
  step must make first, and lets later passes reuse the blocks this one cached.

Token-granular reuse (the tail): full blocks are shared by hash, as in vLLM; past the last full-block hit, the
request's next block is looked up by its tail key (kv_cache.hashing) among cached blocks and freed partial
blocks, and the longest run of leading tokens some block shares with it is reused too: the request gets a new
block and the step first copies that block's KV into it (copy on write: the source stays as it is, for others).
So a prompt sent again recomputes its last token only, not its last partial block, and a question after a
shared document recomputes from where it differs. The tail key carries the namespace the same way block hashes
do, so a tail never crosses salts or tenants.

Namespaces (kv_cache.namespace): make_hasher(namespace, prompt) hashes the blocks lying wholly inside the
longest declared public prefix the prompt starts with without the namespace, the rest under it; cached
private blocks remember their owner so that forget(owner) can drop one tenant's blocks.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Iterable, Sequence

from kv_cache.block_pool import BlockPool
from kv_cache.hashing import BlockHash, BlockHasher, get_hash_fn, init_none_hash
from kv_cache.lookup import CacheRequest, ComputedBlocks, TailHit
from kv_cache.namespace import CacheNamespace, Owner, PublicPrefixes
from kv_cache.retention import RetentionTable
from kv_cache.stats import BlockStored, KVCacheEvent, PrefixCacheStats
from kv_cache.tier_bridge import TierBridge
from kv_cache.tiers import LoadPlan, TierBlock, TierLookup

_LOGITS = "logits"  # sets sequence_key's input apart from a block hash's and a tail key's


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int,
        *,
        enable_caching: bool = True,
        hash_algo: str = "sha256",
        enable_events: bool = False,
        public_prefixes: Iterable[Sequence[int]] = (),
        none_hash: BlockHash | None = None,
        max_retained_fraction: float = 0.5,
    ) -> None:
        """`none_hash`: block 0's parent hash (a disk tier's, derived from its persistent seed), else random.
        `max_retained_fraction`: of the pool, the most that retention requests may hold (kv_cache.retention)."""
        if not 0.0 <= max_retained_fraction <= 1.0:
            raise ValueError(f"max_retained_fraction must be in [0, 1], got {max_retained_fraction}")
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_caching = enable_caching
        self.hash_algo = hash_algo
        self.hash_fn = get_hash_fn(hash_algo)  # validates the name even when caching is off
        self.none_hash: BlockHash = none_hash if none_hash is not None else init_none_hash(self.hash_fn)
        self._events: list[KVCacheEvent] | None = [] if enable_events else None
        self.block_pool = BlockPool(num_blocks, self._events)
        self._req_blocks: dict[str, list[int]] = {}
        self._num_cached: dict[str, int] = {}  # request id -> how many of its leading blocks are cached
        self._stats = PrefixCacheStats()
        self._evictions_reported = 0
        self._copies: list[tuple[int, int]] = []  # (source, destination) for the step being planned
        self.last_pass_cached: frozenset[int] = frozenset()  # the blocks the last pass cached (end_pass)
        self.public_prefixes = PublicPrefixes(public_prefixes)
        self.tiers: TierBridge | None = None
        self.retention = RetentionTable(
            self.block_pool, int(num_blocks * max_retained_fraction) if enable_caching else 0
        )
        self._retained_upto: dict[str, int] = {}  # request id -> its leading blocks retained so far
        self._expiries_reported = 0
        self.clock = time.monotonic  # tests move time

    def attach_tiers(self, tiers: TierLookup) -> None:
        """Put tiers behind the pool: lookups that miss it may load from them (start_load), and every block
        cached from now on is written to them (take_writes)."""
        if self.enable_caching:
            self.tiers = TierBridge(self.block_pool, tiers, self.block_size)

    def set_public_prefixes(self, prefixes: Iterable[Sequence[int]]) -> None:
        """Declare the public prefixes (token ids) for requests made from now on."""
        self.public_prefixes = PublicPrefixes(prefixes)

    def make_hasher(
        self,
        namespace: CacheNamespace | None = None,
        prompt_token_ids: Sequence[int] = (),
    ) -> BlockHasher | None:
        """The hasher a new request keeps its block_hashes with; None when caching is off (nothing is hashed).

        The full blocks of the longest declared public prefix `prompt_token_ids` starts with are hashed
        without `namespace`; a block reaching past that prefix (the one straddling it included) is private."""
        if not self.enable_caching:
            return None
        public = self.public_prefixes.match(prompt_token_ids) if self.public_prefixes else 0
        if namespace is not None and namespace.lora is not None:
            # An adapter changes K and V (kv_cache.namespace): its public-prefix blocks are its own.
            public = 0
        return BlockHasher(
            self.block_size,
            self.hash_fn,
            namespace=namespace,
            num_public_blocks=public // self.block_size,
            none_hash=self.none_hash,
        )

    def get_computed_blocks(
        self, request: CacheRequest, in_flight: Collection[int] = (), *, whole: bool = False
    ) -> ComputedBlocks:
        """The longest run of cached blocks from the start of the request, then the longest run of the next
        block's tokens whose KV some block holds (the tail), capped so that at least the request's last token
        is computed (its logits are needed). Takes no references and records no stats: those are recorded by
        the allocate_slots call that admits the request with this result. `in_flight`: blocks whose KV a step
        still running writes (`end_pass`'s result, for a pass made during that step): never hit.

        `whole`: the caller already holds the logits after the request's last token (`sequence_key`), so the
        last token's KV may be hit too; the result then covers either all request.num_tokens tokens or, as
        without it, at most all but the last (a tier load never covers the last: its logits come with no
        load)."""
        if not self.enable_caching or request.skip_reading_prefix_cache:
            return ComputedBlocks([], 0)
        hashes = request.block_hashes
        limit = request.num_tokens if whole else request.num_tokens - 1
        max_blocks = min(limit // self.block_size, len(hashes))
        lookup = self.block_pool.get_cached_block
        ids: list[int] = []
        for i in range(max_blocks):
            b = lookup(hashes[i])
            if b is None or b in in_flight:
                break
            ids.append(b)
        load = self.tiers.find(hashes[len(ids) : max_blocks]) if self.tiers is not None else []
        if load and (len(ids) + len(load)) * self.block_size > request.num_tokens - 1:
            load.pop()  # the last token's block: only a hit in the pool is worth as much as its logits
        hasher = request.hasher
        public = min(len(ids), hasher.num_public_blocks) if hasher is not None else 0
        bs = self.block_size
        start = len(ids) * bs
        tail = None
        # Tokens of the next block it may reuse: never the last token (unless `whole`), never a whole block
        # (a whole block's hash would have matched).
        want = min(limit - start, bs - 1)
        # A request with a namespace looks tails up only under keys carrying it: in a public block, the
        # namespace-free key would also find an unsalted request's block that left the public prefix there,
        # and the hit's length would tell where (a public prefix reveals nothing of what followed it).
        # (The tail key needs the hashes before block len(ids) only, which the loop above just read.)
        if (
            hasher is not None
            and want > 0
            and not load  # the next block is loaded whole
            and (not hasher.namespace.keys() or len(ids) >= hasher.num_public_blocks)
        ):
            key = hasher.tail_key(hashes, len(ids))
            block, n = self.block_pool.longest_tail(
                key, request.all_token_ids[start : start + want], in_flight=in_flight
            )
            if n:
                tail = TailHit(block, n)
        if load:
            return ComputedBlocks(ids, start + len(load) * bs, request.num_tokens, public * bs, None, load)
        return ComputedBlocks(
            ids, start + (tail.num_tokens if tail else 0), request.num_tokens, public * bs, tail
        )

    def sequence_key(self, request: CacheRequest) -> tuple[BlockHash, Owner | None] | None:
        """A key for the request's whole token sequence under its namespace, and the namespace's owner: what the
        engine keeps the logits after the sequence's last token under, so that a sequence sent again can skip
        its forward (`whole` above). The last block's tail key (which chains every earlier block, and the
        namespace past a public prefix) with that block's tokens and the namespace again: a sequence lying
        wholly in a public prefix is still each namespace's own, so a hit never tells one tenant that another
        sent exactly the public text and nothing after it. None when caching is off or the hasher lags."""
        hasher = request.hasher
        n = request.num_tokens
        if hasher is None or n < 1 or not self.enable_caching:
            return None
        bs = self.block_size
        last = (n - 1) // bs
        hashes = request.block_hashes
        if len(hashes) < last:
            return None
        tokens = request.all_token_ids[last * bs : n]
        namespace = hasher.namespace
        key = self.hash_fn((hasher.tail_key(hashes, last), _LOGITS, tokens, namespace.keys()))
        return key, namespace.owner

    def allocate_slots(
        self, request: CacheRequest, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> list[int] | None:
        """Reserve room for request.num_computed_tokens + computed.num_tokens + num_new_tokens tokens.

        On success: takes a reference to the hit blocks (reviving free ones), allocates new blocks from the
        free queue's head, caches every block now full of known tokens and returns the new block ids (possibly
        empty). On failure (not enough free blocks, counting revived hit blocks): returns None, nothing changed.
        """
        if num_new_tokens < 0:
            raise ValueError(f"num_new_tokens must be >= 0, got {num_new_tokens}")
        if computed is not None and computed.load:
            raise ValueError("a hit that loads blocks from a tier goes to start_load, not allocate_slots")
        rid = request.request_id
        blocks = self._req_blocks.get(rid)
        hit = computed.block_ids if computed is not None else []
        if (hit or (computed is not None and computed.tail)) and (blocks or request.num_computed_tokens):
            raise ValueError(f"request {rid!r} got hit blocks but already holds blocks or computed tokens")
        pool = self.block_pool
        bs = self.block_size
        num_held = len(blocks) if blocks else 0
        reused = computed.num_tokens if computed is not None else 0
        total = request.num_computed_tokens + reused + num_new_tokens
        num_new_blocks = max(0, -(-total // bs) - len(hit) - num_held)
        ref_cnt = pool.ref_cnt
        num_revived = sum(1 for b in hit if ref_cnt[b] == 0) if hit else 0
        if num_new_blocks + num_revived > pool.num_free_blocks:
            # Retention never starves the pool: with no request holding blocks (nothing will free any), the
            # retained blocks yield, oldest of the largest holder first, as many as this admission needs.
            if self._req_blocks or not self.retention.yield_blocks(
                num_new_blocks + num_revived - pool.num_free_blocks
            ):
                return None
            num_revived = sum(1 for b in hit if ref_cnt[b] == 0) if hit else 0
            if num_new_blocks + num_revived > pool.num_free_blocks:
                return None

        if blocks is None:
            blocks = self._req_blocks[rid] = []
        if hit:
            # Revive before taking new blocks, so that the new ones never evict a block this request hits.
            pool.touch(hit)
            blocks.extend(hit)
            self._num_cached[rid] = len(hit)
        new_ids = pool.take(num_new_blocks) if num_new_blocks else []
        blocks.extend(new_ids)
        if computed is not None and computed.tail is not None:
            # The first new block is the request's next one (num_new_tokens >= 1 reach into it). Taking it may
            # have reused the source itself, or another block may take the source later in this pass: either
            # way the copy runs before the step writes anything.
            if new_ids[0] != computed.tail.block:
                self._copies.append((computed.tail.block, new_ids[0]))
        if computed is not None and computed.num_queried_tokens:
            self._stats.record(
                computed.num_queried_tokens,
                computed.num_tokens,
                request.num_preemptions > 0,
                computed.num_public_tokens,
            )
            if self.tiers is not None:
                self._stats.record_tiers(self.tiers.take_tier_hits(rid, len(hit), bs))
        if self.enable_caching:
            # Cache blocks as soon as they are full of known tokens (they are computed in this step), so that
            # a request scheduled later in the same step can already hit them.
            self._cache_full_blocks(request, blocks, min(total, request.num_tokens) // bs)
            if self.retention.max_blocks:
                self._retain(request, blocks, hit)
        return new_ids

    def _retain(self, request: CacheRequest, blocks: list[int], hit: list[int]) -> None:
        """A hit refreshes the retained blocks it reads; a request asking for retention retains its cached
        blocks up to its breakpoint, as one prompt (kv_cache.retention: its leading blocks are what a later
        request can hit), whenever a step caches more of them."""
        now = self.clock()
        if hit:
            self.retention.refresh(hit, now)
        wanted = getattr(request, "retention", None)
        if wanted is None or request.hasher is None:
            return
        ttl, num_tokens = wanted
        rid = request.request_id
        start = self._retained_upto.get(rid, 0)
        end = min(self._num_cached.get(rid, 0), num_tokens // self.block_size)
        if end > start:
            self.retention.retain(blocks[:end], request.hasher.namespace.holder, ttl, now)
            self._retained_upto[rid] = end

    def _cache_full_blocks(self, request: CacheRequest, blocks: list[int], num_full: int) -> None:
        rid = request.request_id
        start = self._num_cached.get(rid, 0)
        hashes = request.block_hashes
        # A hasher that lags behind (should not happen) only costs hits: those blocks get cached next time.
        end = min(num_full, len(hashes))
        if end <= start:
            return
        hasher = request.hasher
        assert hasher is not None  # block hashes come from it
        owners = None
        if (owner := hasher.namespace.owner) is not None:
            # Public blocks (below num_public_blocks) belong to nobody: a tenant's reset must not touch them.
            first_private = hasher.num_public_blocks
            owners = [owner if i >= first_private else None for i in range(start, end)]
        bs = self.block_size
        tokens = request.all_token_ids
        tails = [
            (hasher.tail_key(hashes, i), tuple(tokens[i * bs : (i + 1) * bs])) for i in range(start, end)
        ]
        self.block_pool.cache(blocks[start:end], hashes[start:end], owners, tails)
        self._num_cached[rid] = end
        if self.tiers is not None:
            self.tiers.note_cached(request, blocks, start, end)
        if self._events is not None:
            parent = hashes[start - 1] if start else None
            tokens = request.all_token_ids[start * bs : end * bs]
            lora = hasher.namespace.lora
            self._events.append(BlockStored(hashes[start:end], parent, tokens, bs, lora[0] if lora else None))

    def get_block_ids(self, request_id: str) -> list[int]:
        """The request's whole block table. The live list, not a copy: read it, never mutate it. It grows in
        place as allocate_slots adds blocks; [] for a request holding nothing."""
        return self._req_blocks.get(request_id, [])

    def free(self, request: CacheRequest) -> None:
        """Release all the request's blocks. They keep their hashes and go to the free queue's tail, deepest
        block first, so that a chain is evicted from its end and its shared prefix survives longest. A last
        block holding some computed tokens but not a whole block's is filed as a partial (tail lookups)."""
        rid = request.request_id
        if self.tiers is not None:
            if self.tiers.abandon(rid):
                return  # the loader may be writing into its blocks: finish_loads frees them
            self.tiers.drop(rid)
        self._num_cached.pop(rid, None)
        self._retained_upto.pop(rid, None)
        blocks = self._req_blocks.pop(rid, None)
        if not blocks:
            return
        pool = self.block_pool
        pool.free(reversed(blocks))
        hasher = request.hasher
        computed = request.num_computed_tokens
        last, held = divmod(computed, self.block_size)
        if hasher is None or not held or last >= len(blocks) or last > len(request.block_hashes):
            return
        b = blocks[last]
        if pool.ref_cnt[b] or pool.block_hash[b] is not None:
            return  # still shared, or cached whole (cannot happen for a block with free slots; kept safe)
        owner = hasher.namespace.owner if last >= hasher.num_public_blocks else None
        tokens = tuple(request.all_token_ids[computed - held : computed])
        pool.add_partial(b, hasher.tail_key(request.block_hashes, last), tokens, owner)

    # ---- tiers (kv_cache.tier_bridge) ------------------------------------------------------------------

    def start_load(self, request: CacheRequest, computed: ComputedBlocks) -> bool:
        """Reserve blocks for a hit with tier blocks (computed.load) and queue their load (take_loads); the
        request waits until finish_loads reports it. False, nothing changed, when the blocks are not free."""
        if self.tiers is None or not computed.load:
            raise ValueError("start_load needs tiers and a hit that loads from them")
        rid = request.request_id
        if self._req_blocks.get(rid) or request.num_computed_tokens:
            raise ValueError(f"request {rid!r} loads blocks but already holds blocks or computed tokens")
        table: list[int] = []
        if not self.tiers.start_load(request, computed, table):
            return False
        self._req_blocks[rid] = table
        return True

    def take_loads(self) -> list[LoadPlan]:
        """Loads started since the last call, for the engine's tier copier."""
        return self.tiers.take_loads() if self.tiers is not None else []

    def finish_loads(self, results: Iterable[tuple[str, int]]) -> list[str]:
        """Loads are over: (request id, leading blocks that arrived). Those blocks are cached, every block of
        the request is freed; returns the requests to put back in the queue (not the abandoned ones)."""
        if self.tiers is None:
            return []
        back: list[str] = []
        for rid, arrived in results:
            request, plan = self.tiers.loading.pop(rid)
            blocks = self._req_blocks[rid]
            first = len(blocks) - len(plan.blocks)
            if not plan.abandoned and arrived and plan.epoch == self.tiers.epoch:
                self._num_cached[rid] = first
                self._cache_full_blocks(request, blocks, first + arrived)
                self.tiers.loaded(rid, plan, arrived, first)
            self._num_cached.pop(rid, None)
            del self._req_blocks[rid]
            self.block_pool.free(reversed(blocks))
            if not plan.abandoned:
                back.append(rid)
        return back

    def take_writes(self, failed: Iterable[str] = ()) -> list[TierBlock]:
        """Blocks cached since the last call, pinned, to copy to the tiers now that their step ran (the
        requests in `failed` did not compute theirs: unpinned instead)."""
        return self.tiers.take_writes(failed) if self.tiers is not None else []

    def unpin(self, ids: Iterable[int]) -> None:
        """The tiers copied these blocks' KV out: drop the pins take_writes left on them."""
        if self.tiers is not None:
            self.tiers.unpin(ids)

    @property
    def tier_busy(self) -> bool:
        """Loads running or blocks pinned for writes (the engine must keep polling its tiers)."""
        return self.tiers is not None and self.tiers.busy

    def end_pass(self) -> list[tuple[int, int]]:
        """End of a scheduling pass: the (source, destination) block copies its tail hits need, which the step
        must make before it writes any KV; the blocks the pass cached become reusable as tails."""
        copies, self._copies = self._copies, []
        # A pass made while this pass's step runs must not hit these (get_computed_blocks' in_flight).
        self.last_pass_cached = self.block_pool.end_pass()
        self.retention.expire(self.clock())
        return copies

    def reset_prefix_cache(self, force: bool = False) -> bool:
        """Forget every cached hash; False (nothing changes) while any block is in use, unless `force`: then
        blocks in use keep serving their requests without a hash, as after forget()."""
        self.retention.release_all()  # retained blocks hold references: a reset forgets them first
        if self.tiers is not None:
            self.tiers.epoch += 1
        return self.block_pool.reset(force)

    def forget(self, owner: Owner) -> int:
        """Forget every cached block of `owner`'s private namespace (a tenant's reset), in use or not; returns
        how many. Blocks in use keep serving their requests, but no later request can hit them; public blocks
        and other owners' blocks are untouched."""
        n = self.block_pool.forget(owner)
        self.retention.release_unhashed()
        if self.tiers is not None:
            self.tiers.epoch += 1
        return n

    @property
    def usage(self) -> float:
        """Fraction of blocks in use (ref count > 0)."""
        return 1.0 - self.block_pool.num_free_blocks / self.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.block_pool.num_free_blocks

    @property
    def num_cached_blocks(self) -> int:
        return self.block_pool.num_cached_blocks

    def make_prefix_cache_stats(self) -> PrefixCacheStats:
        """Stats since the last call (then reset)."""
        stats = self._stats
        evictions = self.block_pool.num_evictions
        stats.evictions = evictions - self._evictions_reported
        self._evictions_reported = evictions
        stats.retained_blocks = len(self.retention)
        stats.retention_expiries = self.retention.num_expiries - self._expiries_reported
        self._expiries_reported = self.retention.num_expiries
        self._stats = PrefixCacheStats()
        return stats

    def take_events(self) -> list[KVCacheEvent]:
        """Events since the last call, oldest first ([] when events are off)."""
        if not self._events:
            return []
        events = list(self._events)
        self._events.clear()  # the pool holds the same list
        return events

    def check_invariants(self) -> None:
        """Raise AssertionError unless ref counts, the free queue, the hash map and block tables agree."""
        held = list(self._req_blocks.values()) + self.retention.held()
        if self.tiers is not None:
            held += self.tiers.held()
            assert set(self.tiers.loading) <= set(self._req_blocks), "a loading request holds no blocks"
        self.block_pool.check_invariants(held)
        assert set(self._num_cached) <= set(self._req_blocks), "cached-block counts for unknown requests"
        block_hash = self.block_pool.block_hash
        for rid, n in self._num_cached.items():
            blocks = self._req_blocks[rid]
            assert n <= len(blocks), f"{rid}: {n} cached blocks but only {len(blocks)} held"
            forgotten = self.block_pool.forgotten
            assert all(block_hash[b] is not None or b in forgotten for b in blocks[:n]), (
                f"{rid}: a cached block lost its hash"
            )
        if not self.enable_caching:
            assert self.block_pool.num_cached_blocks == 0, "blocks cached while caching is off"
