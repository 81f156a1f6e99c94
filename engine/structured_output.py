"""Structured outputs: compiling a constraint (JSON schema, JSON object, regex, choice, EBNF grammar) into a
grammar, cached per cache namespace, and one matcher per sequence whose masks the sampler applies.

Engine: xgrammar, measured against llguidance on this 2-core CPU with the default model's 49k vocabulary
(`python -m benchmarks.grammar_engines`, a nested schema, 43 output tokens): mask + accept per token 2.2 us
(xgrammar) vs 14 us (llguidance) median; schema compile 14 ms vs 1.4 ms; tokenizer setup 0.33 s vs 0.62 s.
The per-token mask runs beside every step for every constrained row, while compiling runs once per schema, off
the step thread, and is cached: so the per-token cost decides. xgrammar is also vLLM's and SGLang's default, so
schemas behave as their users expect.

Where the rest lives: the spec and its errors in engine.structured_spec, the compile steps shared with the
sandbox's workers in engine.grammar_compile, the killable trial compiles in engine.grammar_sandbox, the filling
of a step's masks beside the forward and their application to the logits in engine.grammar_masks (which
imports this module; nothing here imports it).

Rules a caller keeps:
- `GrammarCompiler.compile()` is thread-safe and may take long: call it off the engine thread (the async
  engine runs it on its own bounded pool). Results are cached per cache namespace and spec, so a repeated
  schema costs nothing, but only inside the namespace that compiled it: a cache hit answers faster than a
  compile, so a shared cache would tell a tenant which schemas another tenant sent (schemas hold enums of
  customer names, field names). A prefix cache reset forgets the grammars of the namespaces it resets
  (`forget`), as it forgets their KV blocks and tokenizer pieces.
- The cache is bounded by the bytes its grammars hold (xgrammar's `memory_size_bytes`: a 20,000-value enum
  compiles to ~105 MB), least recently used first out; a grammar bigger than the whole cache is refused.
- The mask budget (`mask_budget_s`, CPU time per token) is a request's own: what the masks of all its n
  sequences cost for one token, never shared with or spent by another request, so only a request's own grammar
  decides whether it is refused or failed. Every compiled grammar's first mask is timed before it is handed
  out: one over the budget is refused (the client's 400), and so is a request whose n sequences' first masks
  together are (`check_sequences`). A request whose masks go over the budget later (grammars whose cost grows
  with the output: ambiguous EBNF) fails on its next token (`MaskBudget`, `GrammarTooSlowError`).
- A `GrammarState` belongs to one sequence; `accept()` is called once per generated token, in order (the
  request calls it as its tokens grow), and `fill_mask()` only between two accepts (engine.grammar_masks fills
  it on its own thread while the forward runs, and the runner waits for it before the step ends). A
  preemption recomputes KV, never tokens, so the state stays valid across it.
- The constraint covers generated tokens only: prompts and the prefix cache never see it.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from engine.grammar_compile import check_mask_cost, compile_failure, compile_spec, over_budget, tokenizer_info
from engine.structured_spec import (
    GrammarTooSlowError,
    StructuredOutputError,
    StructuredOutputSpec,
    label,
)
from kv_cache.namespace import CacheNamespace, Owner

if TYPE_CHECKING:
    import torch

    from engine.grammar_sandbox import CompileSandbox

# The names callers of structured outputs know this module by (defined below it, so that holding a spec or
# compiling in a worker never imports the compiler).
__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarState",
    "GrammarTooSlowError",
    "MaskBudget",
    "StructuredOutputError",
    "StructuredOutputSpec",
    "check_sequences",
    "grammar_states",
    "tokenizer_info",
]

CACHE_BYTES = 256 * 1024 * 1024
MASK_BUDGET_S = 0.010  # CPU time of one token's masks; typical schemas take 0.002-0.2 ms
# Consecutive tokens over the budget before a request fails: one slow fill may be a page fault.
MASK_STRIKES = 2


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    spec: StructuredOutputSpec
    compiled: Any  # xgrammar.CompiledGrammar
    mask_budget_s: float = float("inf")
    memory_bytes: int = 0
    first_mask_s: float = 0.0  # CPU time of its first token's mask, when it was compiled


class MaskBudget:
    """One request's per-token mask budget, shared by the `GrammarState`s of its n sequences: what their masks
    cost for the same token position is summed, so n sequences of one grammar spend one budget, and nothing of
    another request's."""

    __slots__ = ("_spent", "budget_s", "sequences")

    def __init__(self, budget_s: float, sequences: int = 1) -> None:
        self.budget_s = budget_s
        self.sequences = sequences
        self._spent: dict[int, float] = {}  # token position -> CPU seconds of its sequences' masks there

    def charge(self, position: int, seconds: float) -> float:
        """Adds one sequence's mask at `position`; returns the request's cost at that position so far."""
        total = self._spent.get(position, 0.0) + seconds
        self._spent[position] = total
        # Sequences step together; one preempted may lag by a token or two. Older positions are done.
        for old in [p for p in self._spent if p < position - 2]:
            del self._spent[old]
        return total

    def spent(self, position: int) -> float:
        """The request's mask cost at `position` so far (CPU seconds)."""
        return self._spent.get(position, 0.0)


class GrammarState:
    """One sequence's position in its grammar, and what its masks cost (CPU seconds, on the filling thread),
    charged to its request's `MaskBudget`."""

    __slots__ = ("_charged", "_matcher", "budget", "last_fill_s", "position", "rejected", "strikes")

    def __init__(self, grammar: CompiledGrammar, budget: MaskBudget | None = None) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(grammar.compiled)
        self.rejected = False  # a token the grammar refused was appended (only if the mask was bypassed)
        self.budget = budget if budget is not None else MaskBudget(grammar.mask_budget_s)
        self.position = 0  # tokens accepted
        self.last_fill_s = 0.0
        self._charged = (-1, 0.0)  # (position, seconds) this state last charged to the budget
        self.strikes = 0  # consecutive tokens whose request's masks went over the budget

    @property
    def budget_s(self) -> float:
        return self.budget.budget_s

    def accept(self, token_id: int) -> None:
        """Raises GrammarTooSlowError (after accepting) once MASK_STRIKES tokens in a row went over budget:
        the caller (the scheduler's update) fails this sequence, and with it its request."""
        if self.rejected or self._matcher.is_terminated():
            return
        if not self._matcher.accept_token(token_id):
            self.rejected = True
        self.position += 1
        if self.strikes >= MASK_STRIKES:
            spent = self.budget.spent(self.position - 1)
            raise GrammarTooSlowError(spent, self.budget_s, self.budget.sequences)

    @property
    def active(self) -> bool:
        """False once the grammar is finished (stop token accepted) or broken: no mask applies any more."""
        return not self.rejected and not self._matcher.is_terminated()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        # CPU time, not wall time: a fill that waited for a core (2 cores, a forward beside it) is not slow.
        start = time.thread_time()
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self.last_fill_s = time.thread_time() - start
        # Filled again at the same position (the sampler's fallback): the new cost replaces the old one.
        pos, before = self._charged
        extra = self.last_fill_s - (before if pos == self.position else 0.0)
        self._charged = (self.position, self.last_fill_s)
        spent = self.budget.charge(self.position, extra)
        self.strikes = self.strikes + 1 if spent > self.budget_s else 0


def grammar_states(grammar: CompiledGrammar | None, sequences: int) -> list[GrammarState | None]:
    """The matchers of one request's `sequences` sequences, sharing the request's one mask budget (all None
    for an unconstrained request)."""
    if grammar is None:
        return [None] * sequences
    budget = MaskBudget(grammar.mask_budget_s, sequences)
    return [GrammarState(grammar, budget) for _ in range(sequences)]


def check_sequences(grammar: CompiledGrammar, sequences: int) -> CompiledGrammar:
    """`grammar` for a request of `sequences` sequences; StructuredOutputError (a 400) if their first masks
    together are over the per-token budget: the request would fail on its first tokens."""
    if grammar.first_mask_s * sequences > grammar.mask_budget_s:
        raise over_budget(grammar.spec, grammar.first_mask_s, grammar.mask_budget_s, sequences)
    return grammar


_Key = tuple[CacheNamespace | None, StructuredOutputSpec]


class GrammarCompiler:
    """Compiles specs for one tokenizer; an LRU cache keyed by (cache namespace, spec), bounded by bytes.
    `on_compile(seconds)` is called for every real compilation (cache misses), from the compiling thread.
    `sandbox`: worker processes that try each compile first, under a timeout, killed on cancellation
    (engine.grammar_sandbox); None compiles in this process only (tests, tiny vocabularies)."""

    def __init__(
        self,
        tokenizer_info: Any,
        *,
        cache_bytes: int = CACHE_BYTES,
        mask_budget_s: float = MASK_BUDGET_S,
        sandbox: CompileSandbox | None = None,
        on_compile: Callable[[float], None] | None = None,
    ) -> None:
        """`tokenizer_info`: an `xgrammar.TokenizerInfo` whose vocab_size is the model's logits width."""
        import xgrammar as xgr

        self.vocab_size: int = tokenizer_info.vocab_size
        self.tokenizer_info = tokenizer_info
        self._xgr = xgr.GrammarCompiler(tokenizer_info, max_threads=2, cache_enabled=False)
        self._cache: OrderedDict[_Key, CompiledGrammar] = OrderedDict()
        # owner -> its grammars' keys (an insertion-ordered set): a tenant's reset costs its own grammars.
        self._owned: dict[Owner, dict[_Key, None]] = {}
        self.cache_bytes = cache_bytes
        self.mask_budget_s = mask_budget_s
        self.sandbox = sandbox
        self.workers = sandbox.workers if sandbox is not None else 1  # compiles that may run at once
        self._bytes = 0
        self._lock = threading.Lock()
        self.on_compile = on_compile
        self.compiles = 0  # real compilations since start: for tests and benchmarks

    @classmethod
    def from_tokenizer(
        cls, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], **kwargs: Any
    ) -> GrammarCompiler:
        """For a Hugging Face tokenizer; `vocab_size` is the model's (its logits may be wider than the
        tokenizer's vocabulary: the padding ids are never allowed)."""
        return cls(tokenizer_info(hf_tokenizer, vocab_size, stop_token_ids), **kwargs)

    def __len__(self) -> int:
        return len(self._cache)

    @property
    def bytes_used(self) -> int:
        return self._bytes

    def cached(
        self, spec: StructuredOutputSpec, namespace: CacheNamespace | None = None
    ) -> CompiledGrammar | None:
        """The namespace's compiled grammar for `spec` if cached (cheap: may run on an event loop)."""
        with self._lock:
            hit = self._cache.get((namespace, spec))
            if hit is not None:
                self._cache.move_to_end((namespace, spec))
            return hit

    def compile(
        self,
        spec: StructuredOutputSpec,
        namespace: CacheNamespace | None = None,
        cancel: threading.Event | None = None,
    ) -> CompiledGrammar:
        """The namespace's grammar for `spec`, compiled unless cached. StructuredOutputError for a spec that
        does not compile, compiles too slowly (the sandbox's timeout), is too big or too slow to follow;
        `engine.grammar_sandbox.CompileCancelled` when `cancel` is set first (with a sandbox)."""
        hit = self.cached(spec, namespace)
        if hit is not None:
            return hit
        first_mask_s = 0.0
        if self.sandbox is not None:
            # Killable, under a timeout and a memory limit: only a compile it finished is repeated here.
            trial = self.sandbox.trial(spec, cancel)
            self._check_size(spec, trial.memory_bytes)
            first_mask_s = trial.first_mask_s
        start = time.perf_counter()
        try:
            compiled = compile_spec(self._xgr, spec)
        except StructuredOutputError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the reason
            raise compile_failure(spec, exc) from None
        seconds = time.perf_counter() - start
        self._check_size(spec, compiled.memory_size_bytes)
        if self.sandbox is None:
            first_mask_s = check_mask_cost(spec, compiled, self.vocab_size, self.mask_budget_s)
        if self.on_compile is not None:
            self.on_compile(seconds)
        grammar = CompiledGrammar(
            spec, compiled, self.mask_budget_s, compiled.memory_size_bytes, first_mask_s
        )
        with self._lock:
            self.compiles += 1
            key = (namespace, spec)
            old = self._cache.pop(key, None)
            if old is not None:
                self._bytes -= old.memory_bytes
            self._cache[key] = grammar
            self._bytes += grammar.memory_bytes
            owner = namespace.owner if namespace is not None else None
            if owner is not None:
                self._owned.setdefault(owner, {})[key] = None
            while self._bytes > self.cache_bytes and len(self._cache) > 1:
                evicted_key, evicted = self._cache.popitem(last=False)
                self._bytes -= evicted.memory_bytes
                self._unindex(evicted_key)
        return grammar

    def forget(self, owner: Owner | None = None) -> None:
        """Forgets every grammar (None), or those of the namespaces `owner` owns (a tenant-scoped reset)."""
        with self._lock:
            if owner is None:
                self._cache.clear()
                self._owned.clear()
                self._bytes = 0
                return
            for key in self._owned.pop(owner, {}):
                self._bytes -= self._cache.pop(key).memory_bytes

    def _unindex(self, key: _Key) -> None:
        owner = key[0].owner if key[0] is not None else None
        if owner is None:
            return
        mine = self._owned[owner]
        del mine[key]
        if not mine:  # an owner with no grammars is not kept: the index never outgrows the cache
            del self._owned[owner]

    def check_invariants(self) -> None:
        """Tests call this: the owner index holds exactly the owned grammars, and the byte count is theirs."""
        with self._lock:
            owned = {k for k in self._cache if k[0] is not None and k[0].owner is not None}
            assert owned == {k for keys in self._owned.values() for k in keys}, "owner index out of step"
            assert all(self._owned.values()), "an owner with no grammars is still indexed"
            assert self._bytes == sum(g.memory_bytes for g in self._cache.values()), "byte count out of step"

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()

    def _check_size(self, spec: StructuredOutputSpec, memory_bytes: int) -> None:
        if memory_bytes > self.cache_bytes:
            raise StructuredOutputError(
                f"The {label(spec.kind)} compiles to {memory_bytes / 2**20:.1f} MiB, more than this server's "
                f"grammar cache holds ({self.cache_bytes / 2**20:.0f} MiB, --grammar-cache-memory)."
            )
