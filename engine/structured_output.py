"""Structured outputs: compiling a constraint (JSON schema, JSON object, regex, choice, EBNF grammar) into a
grammar, one matcher per sequence, and the per-row token masks the sampler applies.

Engine: xgrammar, measured against llguidance on this 2-core CPU with the default model's 49k vocabulary
(`python -m benchmarks.grammar_engines`, a nested schema, 43 output tokens): mask + accept per token 2.2 us
(xgrammar) vs 14 us (llguidance) median; schema compile 14 ms vs 1.4 ms; tokenizer setup 0.33 s vs 0.62 s.
The per-token mask runs on the engine's step thread for every constrained row of every step, while compiling
runs once per schema, off that thread, and is cached: so the per-token cost decides. xgrammar is also vLLM's
and SGLang's default, so schemas behave as their users expect.

JSON is generated with `json.dumps`' separators (", " and ": ") and no other free whitespace: a small model
left free to add whitespace may add it until max_tokens.

Rules a caller keeps:
- `GrammarCompiler.compile()` is thread-safe and may take long: call it off the engine thread (the async
  engine runs it on its own bounded pool). Results are cached per cache namespace and spec, so a repeated
  schema costs nothing, but only inside the namespace that compiled it: a cache hit answers faster than a
  compile, so a shared cache would tell a tenant which schemas another tenant sent (schemas hold enums of
  customer names, field names). A prefix cache reset forgets the grammars of the namespaces it resets
  (`forget`), as it forgets their KV blocks and tokenizer pieces.
- The cache is bounded by the bytes its grammars hold (xgrammar's `memory_size_bytes`: a 20,000-value enum
  compiles to ~105 MB), least recently used first out; a grammar bigger than the whole cache is refused.
- Every compiled grammar's first mask is timed (CPU time) before it is handed out: one whose per-token cost
  is over `mask_budget_s` is refused (the client's 400). A sequence whose mask goes over the budget later
  (grammars whose cost grows with the output: ambiguous EBNF) fails on its next token (`GrammarState`).
- A `GrammarState` belongs to one sequence; `accept()` is called once per generated token, in order (the
  request calls it as its tokens grow), and `fill_mask()` only between two accepts (engine.grammar_masks fills
  it on its own thread while the forward runs, and the runner waits for it before the step ends). A
  preemption recomputes KV, never tokens, so the state stays valid across it.
- The constraint covers generated tokens only: prompts and the prefix cache never see it.
"""

from __future__ import annotations

import json
import re
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from kv_cache.namespace import CacheNamespace, Owner

if TYPE_CHECKING:
    import torch

    from engine.grammar_sandbox import CompileSandbox

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")
CACHE_BYTES = 256 * 1024 * 1024
MASK_BUDGET_S = 0.010  # CPU time of one token's mask; typical schemas take 0.002-0.2 ms
# Consecutive tokens over the budget before a sequence fails: one slow fill may be a page fault.
MASK_STRIKES = 2


@dataclass(frozen=True, slots=True)
class StructuredOutputSpec:
    """What a request's output must match. `kind` is one of KINDS; `spec` is the canonical text (JSON of the
    schema with sorted keys, the regex, JSON of the choice list, the EBNF grammar); with the request's cache
    namespace, the cache key."""

    kind: str
    spec: str = ""


class StructuredOutputError(ValueError):
    """A constraint the grammar engine cannot compile: the client's to fix (a 400 naming `param`)."""

    def __init__(self, message: str, param: str = "response_format") -> None:
        super().__init__(message)
        self.param = param


class GrammarTooSlowError(RuntimeError):
    """A sequence's grammar mask went over the per-token budget: that sequence fails, the batch goes on."""


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    spec: StructuredOutputSpec
    compiled: Any  # xgrammar.CompiledGrammar
    mask_budget_s: float = float("inf")
    memory_bytes: int = 0


class GrammarState:
    """One sequence's position in its grammar, and what its masks cost (CPU seconds, on the filling thread)."""

    __slots__ = ("_matcher", "budget_s", "last_fill_s", "rejected", "strikes")

    def __init__(self, grammar: CompiledGrammar, mask_budget_s: float | None = None) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(grammar.compiled)
        self.rejected = False  # a token the grammar refused was appended (only if the mask was bypassed)
        self.budget_s = grammar.mask_budget_s if mask_budget_s is None else mask_budget_s
        self.last_fill_s = 0.0
        self.strikes = 0  # consecutive masks over the budget

    def accept(self, token_id: int) -> None:
        """Raises GrammarTooSlowError (after accepting) once MASK_STRIKES masks in a row went over budget:
        the caller (the scheduler's update) fails this sequence alone."""
        if self.rejected or self._matcher.is_terminated():
            return
        if not self._matcher.accept_token(token_id):
            self.rejected = True
        if self.strikes >= MASK_STRIKES:
            raise GrammarTooSlowError(
                f"the output constraint cost {self.last_fill_s * 1e3:.1f} ms of CPU per token, over the "
                f"budget of {self.budget_s * 1e3:g} ms (--grammar-mask-budget-ms)"
            )

    @property
    def active(self) -> bool:
        """False once the grammar is finished (stop token accepted) or broken: no mask applies any more."""
        return not self.rejected and not self._matcher.is_terminated()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        # CPU time, not wall time: a fill that waited for a core (2 cores, a forward beside it) is not slow.
        start = time.thread_time()
        self._matcher.fill_next_token_bitmask(bitmask, row)
        self.last_fill_s = time.thread_time() - start
        self.strikes = self.strikes + 1 if self.last_fill_s > self.budget_s else 0


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
        if self.sandbox is not None:
            # Killable, under a timeout and a memory limit: only a compile it finished is repeated here.
            trial = self.sandbox.trial(spec, cancel)
            self._check_size(spec, trial.memory_bytes)
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
            check_mask_cost(spec, compiled, self.vocab_size, self.mask_budget_s)
        if self.on_compile is not None:
            self.on_compile(seconds)
        grammar = CompiledGrammar(spec, compiled, self.mask_budget_s, compiled.memory_size_bytes)
        with self._lock:
            self.compiles += 1
            key = (namespace, spec)
            old = self._cache.pop(key, None)
            if old is not None:
                self._bytes -= old.memory_bytes
            self._cache[key] = grammar
            self._bytes += grammar.memory_bytes
            while self._bytes > self.cache_bytes and len(self._cache) > 1:
                _, evicted = self._cache.popitem(last=False)
                self._bytes -= evicted.memory_bytes
        return grammar

    def forget(self, owner: Owner | None = None) -> None:
        """Forgets every grammar (None), or those of the namespaces `owner` owns (a tenant-scoped reset)."""
        with self._lock:
            if owner is None:
                self._cache.clear()
                self._bytes = 0
                return
            for key in [k for k in self._cache if k[0] is not None and k[0].owner == owner]:
                self._bytes -= self._cache.pop(key).memory_bytes

    def close(self) -> None:
        if self.sandbox is not None:
            self.sandbox.close()

    def _check_size(self, spec: StructuredOutputSpec, memory_bytes: int) -> None:
        if memory_bytes > self.cache_bytes:
            raise StructuredOutputError(
                f"The {_label(spec.kind)} compiles to {memory_bytes / 2**20:.1f} MiB, more than this server's "
                f"grammar cache holds ({self.cache_bytes / 2**20:.0f} MiB, --grammar-cache-memory)."
            )


def tokenizer_info(hf_tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> Any:
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(
        hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
    )


def compile_spec(compiler: Any, spec: StructuredOutputSpec) -> Any:
    """`spec` through an `xgrammar.GrammarCompiler` (here and in the sandbox's workers alike)."""
    # No free whitespace (see the module docstring).
    separators = (", ", ": ")
    if spec.kind == "json_object":
        return compiler.compile_json_schema('{"type": "object"}', any_whitespace=False, separators=separators)
    if spec.kind == "json_schema":
        return compiler.compile_json_schema(
            spec.spec, any_whitespace=False, separators=separators, strict_mode=True
        )
    if spec.kind == "regex":
        return compiler.compile_regex(spec.spec)
    if spec.kind == "choice":
        choices = json.loads(spec.spec)
        if not choices:
            raise StructuredOutputError("guided_choice needs at least one choice.", "guided_choice")
        # EBNF string literals take JSON's escapes.
        rule = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
        return compiler.compile_grammar(f"root ::= {rule}")
    if spec.kind == "grammar":
        return compiler.compile_grammar(spec.spec)
    raise StructuredOutputError(f"unknown structured output kind {spec.kind!r}")


def first_mask_seconds(compiled: Any, vocab_size: int) -> float:
    """CPU seconds of the first token's mask of a compiled grammar."""
    import xgrammar as xgr

    matcher = xgr.GrammarMatcher(compiled)
    bitmask = xgr.allocate_token_bitmask(1, vocab_size)
    start = time.thread_time()
    matcher.fill_next_token_bitmask(bitmask, 0)
    return time.thread_time() - start


def check_mask_cost(spec: StructuredOutputSpec, compiled: Any, vocab_size: int, budget_s: float) -> float:
    """The first token's mask's CPU seconds; StructuredOutputError if that is over `budget_s`: following the
    grammar would slow every step of every request beside it."""
    seconds = first_mask_seconds(compiled, vocab_size)
    if seconds > budget_s:
        raise StructuredOutputError(
            f"The {_label(spec.kind)} costs {seconds * 1e3:.1f} ms of CPU per token to follow, over this "
            f"server's budget of {budget_s * 1e3:g} ms (--grammar-mask-budget-ms)."
        )
    return seconds


def compile_failure(spec: StructuredOutputSpec, exc: BaseException) -> StructuredOutputError:
    """xgrammar's refusal of `spec` as the client's error (its first line says why)."""
    text = str(exc).strip()
    # xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:94: ": the reason is what follows.
    reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[0]) if text else type(exc).__name__
    return StructuredOutputError(f"The {_label(spec.kind)} could not be compiled: {reason}")


def _label(kind: str) -> str:
    return {"json_schema": "JSON schema", "json_object": "JSON object grammar", "regex": "regex"}.get(
        kind, kind
    )


# The sampler's half lives with the mask thread; re-exported for the callers that knew it here.
from engine.grammar_masks import apply_masks as apply_masks  # noqa: E402
