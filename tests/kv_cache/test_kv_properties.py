"""Random scheduler-like operation sequences against KVCacheManager (hypothesis state machine).

After every step: the manager's invariants hold; simulated device pages hold exactly the tokens each running
request has computed; every cached block's page holds the tokens its hash stands for (a hit never returns
stale data), and a tail hit's source holds the tokens reused from it; nothing reused crosses namespaces except
tokens of the writer's public blocks; a router fed only by the events sees exactly the cached hashes; stats
add up. At the end every block is free again (no leaks).
"""

from __future__ import annotations

from hypothesis import event, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from kv_fakes import FakeRequest, snapshot

from kv_cache import (
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    CacheNamespace,
    ComputedBlocks,
    KVCacheManager,
)

BS = 4
NUM_BLOCKS = 8
# Shared prefixes make hits likely; a tiny vocabulary makes identical blocks at different depths likely.
PREFIXES = [[], [1, 2, 3, 4], [1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 0, 0, 0, 0, 1]]
PUBLIC = [[1, 2, 3, 4, 5, 6]]  # a declared public prefix: one full block, then a straddling one
TENANT = CacheNamespace(tenant="t")


class KVMachine(RuleBasedStateMachine):
    enable_caching = True

    def __init__(self) -> None:
        super().__init__()
        self.mgr = KVCacheManager(
            NUM_BLOCKS, BS, enable_caching=self.enable_caching, enable_events=True, public_prefixes=PUBLIC
        )
        self.waiting: list[FakeRequest] = []
        self.running: list[FakeRequest] = []
        self.pages: list[list[int | None]] = [[None] * BS for _ in range(NUM_BLOCKS)]
        # Who computed each slot's K/V: (namespace, tokens of that request's public blocks). Copies carry it.
        self.origin: list[list[tuple[CacheNamespace | None, int] | None]] = [
            [None] * BS for _ in range(NUM_BLOCKS)
        ]
        self.namespaces: dict[str, CacheNamespace | None] = {}
        self.hash_tokens: dict[bytes, list[int]] = {}  # what each block hash stands for
        self.router: set[bytes] = set()
        self.expected_hits = 0
        self.expected_queries = 0
        self.next_id = 0

    def _note_hashes(self, req: FakeRequest) -> None:
        for i, h in enumerate(req.block_hashes):
            tokens = req.all_token_ids[i * BS : (i + 1) * BS]
            assert self.hash_tokens.setdefault(h, tokens) == tokens, "one hash for two different blocks"

    def _write(self, req: FakeRequest, start: int, n: int) -> None:
        """What the model runner does: store the K/V of positions start .. start + n - 1."""
        blocks = self.mgr.get_block_ids(req.request_id)
        assert req.hasher is not None or not self.enable_caching
        public = req.hasher.num_public_blocks * BS if req.hasher is not None else 0
        for pos in range(start, start + n):
            self.pages[blocks[pos // BS]][pos % BS] = req.all_token_ids[pos]
            self.origin[blocks[pos // BS]][pos % BS] = (self.namespaces[req.request_id], public)

    def _copy(self, copies: list[tuple[int, int]]) -> None:
        """What the runner does first in a step: copy whole blocks, every source read before any write."""
        read = [(list(self.pages[src]), list(self.origin[src])) for src, _ in copies]
        for (_, dst), (page, origin) in zip(copies, read, strict=True):
            self.pages[dst], self.origin[dst] = page, origin
            event("tail copied")

    def _check_reuse(self, req: FakeRequest, blocks: list[int], computed: ComputedBlocks) -> None:
        """The tokens the request reused, as held by `blocks` (its table), came from its own namespace, or from
        a position both sides hash without one: unsalted, or in a public block for full blocks (as before
        tails); for a tail only when the reader is unsalted (a tail found under a namespace-free key would
        tell a tenant where someone else's prompt left the public prefix)."""
        ns = self.namespaces[req.request_id]
        public = req.hasher.num_public_blocks * BS if req.hasher is not None else 0
        full = len(computed.block_ids) * BS
        for pos in range(computed.num_tokens):
            origin = self.origin[blocks[pos // BS]][pos % BS]
            assert origin is not None, "reused a slot nobody wrote"
            writer_ns, writer_public = origin
            writer_free = writer_ns is None or pos < writer_public  # the writer hashed it namespace-free
            shared = writer_free and (ns is None or (pos < public and pos < full))
            assert writer_ns == ns or shared, f"position {pos} crossed namespaces"

    def _allocate(self, req: FakeRequest, n: int, computed_tokens: int, computed: object = None) -> bool:
        before = snapshot(self.mgr)
        new = self.mgr.allocate_slots(req, n, computed)  # type: ignore[arg-type]
        copies = self.mgr.end_pass()  # one rule is one step: the pass ends, the runner copies, then computes
        if new is None:
            assert snapshot(self.mgr) == before, "a failed allocation changed state"
            assert copies == []
            event("allocation refused")
            return False
        self._copy(copies)
        if computed is not None:
            self._check_reuse(req, self.mgr.get_block_ids(req.request_id), computed)  # type: ignore[arg-type]
        if self.mgr.block_pool._dups:
            event("a hash held by two blocks")
        self._write(req, computed_tokens, n)
        req.num_computed_tokens = computed_tokens + n
        return True

    @rule(
        prefix=st.sampled_from(PREFIXES),
        tail=st.lists(st.integers(0, 3), max_size=14),
        ns=st.sampled_from([None, None, CacheNamespace(salt="a"), TENANT]),
        skip=st.sampled_from([False, False, False, True]),
    )
    def add_request(self, prefix: list[int], tail: list[int], ns: CacheNamespace | None, skip: bool) -> None:
        tokens = prefix + tail or [0]
        hasher = self.mgr.make_hasher(ns, tokens)
        req = FakeRequest(f"r{self.next_id}", tokens, hasher, skip_reading_prefix_cache=skip)
        self.namespaces[req.request_id] = ns
        self.next_id += 1
        self._note_hashes(req)
        self.waiting.append(req)

    @precondition(lambda self: self.waiting)
    @rule(data=st.data())
    def schedule_waiting(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.waiting))
        computed = self.mgr.get_computed_blocks(req)
        counted = self.enable_caching and not req.skip_reading_prefix_cache
        start = len(computed.block_ids) * BS
        tail = computed.tail
        assert computed.num_tokens == start + (tail.num_tokens if tail else 0) < req.num_tokens
        for i, b in enumerate(computed.block_ids):
            assert self.pages[b] == req.all_token_ids[i * BS : (i + 1) * BS], "hit on a block with other data"
        if tail is not None:
            event("tail hit")
            assert 0 < tail.num_tokens < BS
            held = self.pages[tail.block][: tail.num_tokens]
            assert held == req.all_token_ids[start : start + tail.num_tokens], "tail hit on other data"
        if computed.block_ids:
            event("prefix hit")
            if any(self.mgr.block_pool.ref_cnt[b] == 0 for b in computed.block_ids):
                event("hit revives a free block")
        n = data.draw(st.integers(1, req.num_tokens - computed.num_tokens))
        if self._allocate(req, n, computed.num_tokens, computed):
            # Stats are per admission: a lookup whose allocation fails is not counted.
            if counted:
                self.expected_queries += req.num_tokens
                self.expected_hits += computed.num_tokens
            self.waiting.remove(req)
            self.running.append(req)

    @precondition(lambda self: self.running)
    @rule(data=st.data())
    def step_running(self, data: st.DataObject) -> None:
        req = data.draw(st.sampled_from(self.running))
        if req.num_computed_tokens < req.num_tokens:  # next prefill chunk
            n = data.draw(st.integers(1, req.num_tokens - req.num_computed_tokens))
        else:  # decode: the sampled token arrives, then is scheduled
            req.append(data.draw(st.integers(0, 3)))
            self._note_hashes(req)
            n = 1
        self._allocate(req, n, req.num_computed_tokens)

    @precondition(lambda self: self.running)
    @rule(data=st.data(), preempt=st.booleans())
    def finish_or_preempt(self, data: st.DataObject, preempt: bool) -> None:
        req = data.draw(st.sampled_from(self.running))
        self.mgr.free(req)
        self.running.remove(req)
        if preempt:  # preemption by recompute: back to waiting with nothing computed
            req.num_computed_tokens = 0
            req.num_preemptions += 1
            self.waiting.append(req)

    @rule()
    def forget_tenant(self) -> None:
        """A tenant's reset: allowed while its requests run; afterwards none of its blocks is cached."""
        self.mgr.forget(("tenant", "t"))
        assert ("tenant", "t") not in self.mgr.block_pool.block_owner

    @rule()
    def reset(self) -> None:
        assert self.mgr.reset_prefix_cache() == (not self.running)

    @invariant()
    def consistent(self) -> None:
        mgr = self.mgr
        mgr.check_invariants()
        pool = mgr.block_pool
        for req in self.running:
            blocks = mgr.get_block_ids(req.request_id)
            assert len(blocks) * BS >= req.num_computed_tokens
            for pos in range(req.num_computed_tokens):
                assert self.pages[blocks[pos // BS]][pos % BS] == req.all_token_ids[pos]
        for req in self.waiting:
            assert mgr.get_block_ids(req.request_id) == []
        for b, h in enumerate(pool.block_hash):
            if h is not None:
                assert self.pages[b] == self.hash_tokens[h], "a cached block holds other tokens than its hash"
        for ev in mgr.take_events():
            if isinstance(ev, BlockStored):
                self.router.update(ev.block_hashes)
            elif isinstance(ev, BlockRemoved):
                event("cached block evicted")
                self.router.difference_update(ev.block_hashes)
            else:
                assert isinstance(ev, AllBlocksCleared)
                self.router.clear()
        assert self.router == {h for h in pool.block_hash if h is not None}
        stats = mgr.make_prefix_cache_stats()
        assert stats.queries + stats.preempted_queries == self.expected_queries
        assert stats.hits + stats.preempted_hits == self.expected_hits
        self.expected_queries = self.expected_hits = 0
        assert mgr.usage == 1 - mgr.num_free_blocks / NUM_BLOCKS
        if not self.enable_caching:
            assert mgr.num_cached_blocks == 0

    def teardown(self) -> None:
        for req in self.running:
            self.mgr.free(req)
        self.mgr.check_invariants()
        assert self.mgr.num_free_blocks == NUM_BLOCKS, "blocks leaked"
        assert self.mgr.block_pool.ref_cnt == [0] * NUM_BLOCKS


class KVMachineNoCaching(KVMachine):
    enable_caching = False


TestKVManagerRandomOps = KVMachine.TestCase
TestKVManagerRandomOps.settings = settings(max_examples=200, stateful_step_count=50, deadline=None)
TestKVManagerRandomOpsNoCaching = KVMachineNoCaching.TestCase
TestKVManagerRandomOpsNoCaching.settings = settings(max_examples=40, stateful_step_count=30, deadline=None)
