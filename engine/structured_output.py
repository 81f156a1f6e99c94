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
  engine runs it in a worker). Results are cached by the spec, so a repeated schema costs nothing.
- A `GrammarState` belongs to one sequence; `accept()` is called once per generated token, in order (the
  request calls it as its tokens grow), and `fill_mask()` only between two accepts. A preemption recomputes
  KV, never tokens, so the state stays valid across it.
- The constraint covers generated tokens only: prompts and the prefix cache never see it.
"""

from __future__ import annotations

import json
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")


@dataclass(frozen=True, slots=True)
class StructuredOutputSpec:
    """What a request's output must match. `kind` is one of KINDS; `spec` is the canonical text (JSON of the
    schema with sorted keys, the regex, JSON of the choice list, the EBNF grammar); together the cache key."""

    kind: str
    spec: str = ""


class StructuredOutputError(ValueError):
    """A constraint the grammar engine cannot compile: the client's to fix (a 400 naming `param`)."""

    def __init__(self, message: str, param: str = "response_format") -> None:
        super().__init__(message)
        self.param = param


@dataclass(frozen=True, slots=True)
class CompiledGrammar:
    spec: StructuredOutputSpec
    compiled: Any  # xgrammar.CompiledGrammar


class GrammarState:
    """One sequence's position in its grammar."""

    __slots__ = ("_matcher", "rejected")

    def __init__(self, grammar: CompiledGrammar) -> None:
        import xgrammar as xgr

        self._matcher = xgr.GrammarMatcher(grammar.compiled)
        self.rejected = False  # a token the grammar refused was appended (only if the mask was bypassed)

    def accept(self, token_id: int) -> None:
        if self.rejected or self._matcher.is_terminated():
            return
        if not self._matcher.accept_token(token_id):
            self.rejected = True

    @property
    def active(self) -> bool:
        """False once the grammar is finished (stop token accepted) or broken: no mask applies any more."""
        return not self.rejected and not self._matcher.is_terminated()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(bitmask, row)


class GrammarCompiler:
    """Compiles specs for one tokenizer; an LRU cache keyed by spec. `on_compile(seconds)` is called for
    every real compilation (cache misses), from the compiling thread."""

    def __init__(
        self,
        tokenizer_info: Any,
        *,
        cache_size: int = 512,
        on_compile: Callable[[float], None] | None = None,
    ) -> None:
        """`tokenizer_info`: an `xgrammar.TokenizerInfo` whose vocab_size is the model's logits width."""
        import xgrammar as xgr

        self.vocab_size: int = tokenizer_info.vocab_size
        self._xgr = xgr.GrammarCompiler(tokenizer_info, max_threads=2, cache_enabled=False)
        self._cache: OrderedDict[StructuredOutputSpec, CompiledGrammar] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.on_compile = on_compile

    @classmethod
    def from_tokenizer(
        cls, hf_tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int], **kwargs: Any
    ) -> GrammarCompiler:
        """For a Hugging Face tokenizer; `vocab_size` is the model's (its logits may be wider than the
        tokenizer's vocabulary: the padding ids are never allowed)."""
        import xgrammar as xgr

        info = xgr.TokenizerInfo.from_huggingface(
            hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
        )
        return cls(info, **kwargs)

    def compile(self, spec: StructuredOutputSpec) -> CompiledGrammar:
        with self._lock:
            hit = self._cache.get(spec)
            if hit is not None:
                self._cache.move_to_end(spec)
                return hit
        start = time.perf_counter()
        try:
            compiled = CompiledGrammar(spec, self._compile(spec))
        except StructuredOutputError:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError with the reason
            reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StructuredOutputError(f"The {_label(spec.kind)} could not be compiled: {reason}") from None
        if self.on_compile is not None:
            self.on_compile(time.perf_counter() - start)
        with self._lock:
            self._cache[spec] = compiled
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: StructuredOutputSpec) -> Any:
        # No free whitespace (see the module docstring).
        separators = (", ", ": ")
        if spec.kind == "json_object":
            return self._xgr.compile_json_schema(
                '{"type": "object"}', any_whitespace=False, separators=separators
            )
        if spec.kind == "json_schema":
            return self._xgr.compile_json_schema(
                spec.spec, any_whitespace=False, separators=separators, strict_mode=True
            )
        if spec.kind == "regex":
            return self._xgr.compile_regex(spec.spec)
        if spec.kind == "choice":
            choices = json.loads(spec.spec)
            if not choices:
                raise StructuredOutputError("guided_choice needs at least one choice.", "guided_choice")
            # EBNF string literals take JSON's escapes.
            rule = " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)
            return self._xgr.compile_grammar(f"root ::= {rule}")
        if spec.kind == "grammar":
            return self._xgr.compile_grammar(spec.spec)
        raise StructuredOutputError(f"unknown structured output kind {spec.kind!r}")


def _label(kind: str) -> str:
    return {"json_schema": "JSON schema", "json_object": "JSON object grammar", "regex": "regex"}.get(
        kind, kind
    )


def apply_masks(
    logits: torch.Tensor, states: list[tuple[int, GrammarState]], vocab_size: int
) -> torch.Tensor:
    """Returns logits with each (row, state)'s disallowed tokens at -inf; other rows keep their exact values
    (rows are gathered, masked and scattered back: no operation spans rows). One host->device copy."""
    import torch
    import xgrammar as xgr

    bitmask = xgr.allocate_token_bitmask(len(states), vocab_size)
    for j, (_, state) in enumerate(states):
        state.fill_mask(bitmask, j)
    rows = torch.tensor([r for r, _ in states], dtype=torch.int64)
    packed = torch.cat([rows, bitmask.view(-1).to(torch.int64)]).to(logits.device, non_blocking=True)
    idx, words = packed[: len(states)], packed[len(states) :].to(torch.int32).view(len(states), -1)
    # Bit b of word w allows token 32 * w + b.
    shifts = torch.arange(32, device=logits.device, dtype=torch.int32)
    allowed = ((words.unsqueeze(-1) >> shifts) & 1).bool().view(len(states), -1)
    n = logits.shape[1]
    if allowed.shape[1] < n:  # logits wider than the tokenizer's vocabulary: padding ids are never allowed
        allowed = torch.nn.functional.pad(allowed, (0, n - allowed.shape[1]), value=False)
    sub = logits.index_select(0, idx).masked_fill(~allowed[:, :n], float("-inf"))
    return logits.index_copy(0, idx, sub)
