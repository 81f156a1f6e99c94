"""The compiled-grammar cache and its bounds: per cache namespace (a tenant's hit never answers another
tenant's schema), forgotten with the prefix cache, bounded by bytes; grammars over the per-token mask budget
are refused or fail their sequence; masks fill on their own thread beside the forward. A tiny raw vocabulary
keeps these fast (the sandbox's worker processes are in test_grammar_sandbox.py)."""

from __future__ import annotations

import json
import threading

import pytest
import torch
import xgrammar as xgr

from engine.grammar_masks import MaskFiller, apply_masks
from engine.outputs import ScheduledRequest
from engine.sampling_params import SamplingParams
from engine.structured_output import (
    GrammarCompiler,
    GrammarState,
    GrammarTooSlowError,
    MaskBudget,
    StructuredOutputError,
    StructuredOutputSpec,
)
from kv_cache.namespace import CacheNamespace

EOS = 0
VOCAB = ["<eos>", "{", "}", '"', ":", ",", " ", "[", "]", "a", "b", "ab", "1", "2", "12", "true", "x", "y"]
V = 40
SECRET = StructuredOutputSpec(
    "json_schema", json.dumps({"type": "string", "enum": ["acme corp", "globex"]}, sort_keys=True)
)
A = CacheNamespace(tenant="a")
A_SALTED = CacheNamespace(tenant="a", salt="s")
B = CacheNamespace(tenant="b")
SALT_ONLY = CacheNamespace(salt="b")


def _info() -> xgr.TokenizerInfo:
    return xgr.TokenizerInfo(VOCAB, vocab_type=xgr.VocabType.RAW, vocab_size=V, stop_token_ids=[EOS])


def test_another_namespace_never_hits_a_tenants_cached_schema() -> None:
    compiler = GrammarCompiler(_info())
    first = compiler.compile(SECRET, A)
    assert compiler.compiles == 1 and compiler.cached(SECRET, A) is first
    # Tenant B, a salt-only namespace and the unsalted one each find nothing: they pay a compile of their own.
    for other in (B, SALT_ONLY, None, A_SALTED):
        assert compiler.cached(SECRET, other) is None
    compiler.compile(SECRET, B)
    assert compiler.compiles == 2 and compiler.compile(SECRET, B) is not first
    assert compiler.compile(SECRET, A) is first and compiler.compiles == 2  # A's own repeat is a hit
    assert len(compiler) == 2


def test_forget_drops_one_owners_grammars_or_all() -> None:
    compiler = GrammarCompiler(_info())
    for ns in (A, A_SALTED, B, SALT_ONLY, None):
        compiler.compile(SECRET, ns)
    compiler.forget(("tenant", "a"))  # a tenant's reset: every salt it used
    assert compiler.cached(SECRET, A) is None and compiler.cached(SECRET, A_SALTED) is None
    assert all(compiler.cached(SECRET, ns) is not None for ns in (B, SALT_ONLY, None))
    compiler.forget()
    assert len(compiler) == 0 and compiler.bytes_used == 0


def test_the_cache_is_bounded_by_bytes_least_recently_used_first() -> None:
    probe = GrammarCompiler(_info())
    size = probe.compile(SECRET).memory_bytes
    assert size > 0
    compiler = GrammarCompiler(_info(), cache_bytes=int(size * 2.5))
    for ns in (A, B):
        compiler.compile(SECRET, ns)
    compiler.cached(SECRET, A)  # A is now the most recently used
    compiler.compile(SECRET, SALT_ONLY)
    assert compiler.bytes_used <= compiler.cache_bytes
    assert compiler.cached(SECRET, B) is None  # evicted
    assert compiler.cached(SECRET, A) is not None and compiler.cached(SECRET, SALT_ONLY) is not None
    small = GrammarCompiler(_info(), cache_bytes=size - 1)
    with pytest.raises(StructuredOutputError, match="grammar cache") as info:
        small.compile(SECRET)
    assert info.value.param == "response_format" and len(small) == 0


def test_a_grammar_over_the_mask_budget_is_refused_before_any_request_runs_it() -> None:
    compiler = GrammarCompiler(_info(), mask_budget_s=0.0)
    with pytest.raises(StructuredOutputError, match="per token") as info:
        compiler.compile(SECRET)
    assert info.value.param == "response_format" and len(compiler) == 0


def test_a_sequence_whose_masks_stay_over_budget_fails_on_its_next_token() -> None:
    grammar = GrammarCompiler(_info()).compile(StructuredOutputSpec("regex", "[xy]+"))
    state = GrammarState(grammar, MaskBudget(-1.0))  # every fill is over it
    bitmask = xgr.allocate_token_bitmask(1, V)
    state.fill_mask(bitmask, 0)
    state.accept(VOCAB.index("x"))  # one slow mask may be a page fault: no failure yet
    state.fill_mask(bitmask, 0)
    with pytest.raises(GrammarTooSlowError, match="budget"):
        state.accept(VOCAB.index("y"))
    ok = GrammarState(grammar)  # the compiler's budget (10 ms): a regex this small never reaches it
    for tok in "xyx":
        ok.fill_mask(bitmask, 0)
        ok.accept(VOCAB.index(tok))
    assert ok.strikes == 0 and ok.last_fill_s < grammar.mask_budget_s


class _SlowState:
    """A GrammarState stand-in that proves its mask is filled while the caller's forward is still running."""

    def __init__(self, inner: GrammarState, forward_running: threading.Event) -> None:
        self.inner = inner
        self.forward_running = forward_running
        self.thread = ""
        self.during_forward = False

    active = True

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self.thread = threading.current_thread().name
        self.during_forward = self.forward_running.wait(timeout=10)
        self.inner.fill_mask(bitmask, row)


def _sched(rid: str, grammar: object | None) -> ScheduledRequest:
    return ScheduledRequest(rid, [5], 2, [0], True, SamplingParams(), [5, 6, 7], 3, 0, grammar=grammar)


def test_masks_fill_on_their_own_thread_while_the_forward_runs() -> None:
    compiler = GrammarCompiler(_info())
    forward_running = threading.Event()
    slow = _SlowState(GrammarState(compiler.compile(SECRET)), forward_running)
    reqs = [_sched("free", None), _sched("constrained", slow)]
    filler = MaskFiller(V)
    with filler.filling(reqs) as masks:
        assert masks is not None and masks.rows == [1]
        forward_running.set()  # "the forward": the fill must already be under way beside it
        logits = torch.zeros(2, V)
        out = apply_masks(logits, [(1, slow)], V, masks)  # type: ignore[list-item]
    filler.close()
    assert slow.during_forward and slow.thread.startswith("brine-grammar-mask")
    assert torch.equal(out[0], logits[0])  # the free row keeps its bits
    assert set(torch.nonzero(out[1] > float("-inf")).flatten().tolist()) == {VOCAB.index('"')}
    with filler.filling([_sched("free", None)]) as none:
        assert none is None  # nothing constrained: no thread, no bitmask
