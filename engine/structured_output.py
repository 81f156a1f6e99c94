"""Structured outputs: compiling a constraint (JSON schema, JSON object, regex, choice, EBNF grammar) into a
grammar, cached per cache namespace, for the matchers (engine.grammar_state) whose masks the sampler applies.

Engine: xgrammar, measured against llguidance on this 2-core CPU with the default model's 49k vocabulary
(`python -m benchmarks.grammar_engines`, a nested schema, 43 output tokens): mask + accept per token 2.2 us
(xgrammar) vs 14 us (llguidance) median; schema compile 14 ms vs 1.4 ms; tokenizer setup 0.33 s vs 0.62 s.
The per-token mask runs beside every step for every constrained row, while compiling runs once per schema, off
the step thread, and is cached: so the per-token cost decides. xgrammar is also vLLM's and SGLang's default, so
schemas behave as their users expect.

Where the rest lives, each importing only the ones before it: the spec and its errors in
engine.structured_spec, the compile steps shared with the sandbox's workers in engine.grammar_compile, a
sequence's matcher and its request's mask budget in engine.grammar_state, the killable trial compiles in
engine.grammar_sandbox, this module's compiler and cache, then the filling of a step's masks beside the forward
and their application to the logits in engine.grammar_masks (nothing here imports it).

Rules a caller keeps:
- `GrammarCompiler.compile()` is thread-safe and may take long: call it off the engine thread (the async
  engine runs it on its own bounded pool). Results are cached per cache namespace and spec, so a repeated
  schema costs nothing, but only inside the namespace that compiled it: a cache hit answers faster than a
  compile, so a shared cache would tell a tenant which schemas another tenant sent (schemas hold enums of
  customer names, field names). A prefix cache reset forgets the grammars of the namespaces it resets
  (`forget`), as it forgets their KV blocks and tokenizer pieces. The one exception is the operator's public
  grammars (`add_public`, engine.grammar_public): compiled before serving, so that no tenant's request ever
  times their compile, and shared by every namespace.
- The cache is bounded by the bytes its grammars hold (xgrammar's `memory_size_bytes`: a 20,000-value enum
  compiles to ~105 MB), least recently used first out; a grammar bigger than the whole cache is refused.
- Every compiled grammar's first mask is timed (CPU time) before it is handed out: one over the per-token
  budget (`mask_budget_s`) is refused, the client's 400. The budget is a request's own, its n sequences'
  masks together, and what happens past it is engine.grammar_state's (`MaskBudget`, `GrammarState`).
- The constraint covers generated tokens only: prompts and the prefix cache never see it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any

from engine.grammar_compile import check_mask_cost, compile_failure, compile_spec, tokenizer_info
from engine.grammar_public import PublicGrammarError
from engine.grammar_state import (
    MASK_STRIKES,
    CompiledGrammar,
    GrammarState,
    MaskBudget,
    check_sequences,
    grammar_states,
)
from engine.owner_index import OwnerIndex
from engine.structured_spec import (
    GrammarTooSlowError,
    StructuredOutputError,
    StructuredOutputSpec,
    label,
)
from kv_cache.namespace import CacheNamespace, Owner

if TYPE_CHECKING:
    from engine.grammar_sandbox import CompileSandbox

logger = logging.getLogger(__name__)

# The names callers of structured outputs know this module by (defined below it, so that holding a spec or
# compiling in a worker never imports the compiler).
__all__ = [
    "CompiledGrammar",
    "GrammarCompiler",
    "GrammarState",
    "MASK_STRIKES",
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
        # The operator's public grammars (engine.grammar_public), any namespace's: written before serving only.
        self._public: dict[StructuredOutputSpec, CompiledGrammar] = {}
        self.public_bytes = 0  # theirs, apart from cache_bytes: never evicted
        # owner -> its grammars' keys (an insertion-ordered set): a tenant's reset costs its own grammars.
        self._owned: OwnerIndex[_Key] = OwnerIndex()
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
        """The namespace's compiled grammar for `spec` if cached, or the public one (cheap: may run on an event
        loop)."""
        public = self._public.get(spec)
        if public is not None:
            return public
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
        first_mask_s = None
        if self.sandbox is not None:
            # Killable, under a timeout and a memory limit: only a compile it finished is repeated here.
            trial = self.sandbox.trial(spec, cancel)
            self._check_size(spec, trial.memory_bytes)
            first_mask_s = trial.first_mask_s
        grammar, seconds = self._compile_here(spec, first_mask_s)
        if self.on_compile is not None:
            self.on_compile(seconds)
        with self._lock:
            self.compiles += 1
            key = (namespace, spec)
            old = self._cache.pop(key, None)
            if old is not None:
                self._bytes -= old.memory_bytes
            self._cache[key] = grammar
            self._bytes += grammar.memory_bytes
            self._owned.add(key)
            while self._bytes > self.cache_bytes and len(self._cache) > 1:
                evicted_key, evicted = self._cache.popitem(last=False)
                self._bytes -= evicted.memory_bytes
                self._owned.discard(evicted_key)
        return grammar

    def add_public(self, named: Iterable[tuple[str, StructuredOutputSpec]]) -> None:
        """Compiles the operator's public grammars ((file name, spec): engine.grammar_public) for every
        namespace: any namespace's `cached` finds them, and neither eviction nor a reset drops them. Call
        before serving (in this process, no sandbox: the operator's own files). PublicGrammarError names a
        file that does not compile or is over a bound."""
        for name, spec in named:
            try:
                grammar, _ = self._compile_here(spec, None)
            except StructuredOutputError as exc:
                raise PublicGrammarError(f"public grammar {name}: {exc}") from None
            if spec not in self._public:
                self.public_bytes += grammar.memory_bytes
                self._public[spec] = grammar
        if self._public:
            logger.info(
                "public grammars: %d compiled (%.1f MiB), shared by every namespace",
                len(self._public),
                self.public_bytes / 2**20,
            )

    @property
    def public_specs(self) -> list[StructuredOutputSpec]:
        return list(self._public)

    def forget(self, owner: Owner | None = None) -> None:
        """Forgets every grammar (None), or those of the namespaces `owner` owns (a tenant-scoped reset)."""
        with self._lock:
            if owner is None:
                self._cache.clear()
                self._owned.clear()
                self._bytes = 0
                return
            for key in self._owned.pop(owner):
                self._bytes -= self._cache.pop(key).memory_bytes

    def check_invariants(self) -> None:
        """Tests call this: the owner index holds exactly the owned grammars, and the byte count is theirs."""
        with self._lock:
            self._owned.check(self._cache)
            assert self._bytes == sum(g.memory_bytes for g in self._cache.values()), "byte count out of step"

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()

    def _compile_here(
        self, spec: StructuredOutputSpec, first_mask_s: float | None
    ) -> tuple[CompiledGrammar, float]:
        """`spec` compiled in this process, and the seconds it took. `first_mask_s`: its first mask's cost as
        the sandbox measured it (None: measure it here, refusing it over the budget)."""
        start = time.perf_counter()
        try:
            compiled = compile_spec(self._xgr, spec)
        except StructuredOutputError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the reason
            raise compile_failure(spec, exc) from None
        seconds = time.perf_counter() - start
        self._check_size(spec, compiled.memory_size_bytes)
        if first_mask_s is None:
            first_mask_s = check_mask_cost(spec, compiled, self.vocab_size, self.mask_budget_s)
        grammar = CompiledGrammar(
            spec, compiled, self.mask_budget_s, compiled.memory_size_bytes, first_mask_s
        )
        return grammar, seconds

    def _check_size(self, spec: StructuredOutputSpec, memory_bytes: int) -> None:
        if memory_bytes > self.cache_bytes:
            raise StructuredOutputError(
                f"The {label(spec.kind)} compiles to {memory_bytes / 2**20:.1f} MiB, more than this server's "
                f"grammar cache holds ({self.cache_bytes / 2**20:.0f} MiB, --grammar-cache-memory)."
            )
