"""Turning a `StructuredOutputSpec` into an xgrammar grammar, and what following it costs: the steps that
the server's compiler (engine.structured_output) and the sandbox's worker processes (engine.grammar_sandbox)
both take, so that a trial in a worker and the compile after it do the same thing.

JSON is generated with `json.dumps`' separators (", " and ": ") and no other free whitespace: a small model
left free to add whitespace may add it until max_tokens.

Imports only engine.structured_spec (and xgrammar, lazily: a server that never sees a constraint never loads
it).
"""

from __future__ import annotations

import json
import re
import time
from collections.abc import Iterable
from typing import Any

from engine.structured_spec import StructuredOutputError, StructuredOutputSpec, label


def tokenizer_info(hf_tokenizer: Any, vocab_size: int, stop_token_ids: Iterable[int]) -> Any:
    """An `xgrammar.TokenizerInfo` for a Hugging Face tokenizer; `vocab_size` is the model's (its logits may
    be wider than the tokenizer's vocabulary: the padding ids are never allowed)."""
    import xgrammar as xgr

    return xgr.TokenizerInfo.from_huggingface(
        hf_tokenizer, vocab_size=vocab_size, stop_token_ids=sorted(stop_token_ids)
    )


def compile_spec(compiler: Any, spec: StructuredOutputSpec) -> Any:
    """`spec` through an `xgrammar.GrammarCompiler` (in the server and in the sandbox's workers alike)."""
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
        raise over_budget(spec, seconds, budget_s)
    return seconds


def over_budget(
    spec: StructuredOutputSpec, per_sequence_s: float, budget_s: float, sequences: int = 1
) -> StructuredOutputError:
    """The 400 for a grammar whose first mask, times the request's sequences, is over the per-token budget."""
    cost = f"{per_sequence_s * 1e3:.1f} ms of CPU per token"
    if sequences > 1:
        cost = f"{per_sequence_s * sequences * 1e3:.1f} ms of CPU per token ({sequences} sequences)"
    return StructuredOutputError(
        f"The {label(spec.kind)} costs {cost} to follow, over this server's budget of {budget_s * 1e3:g} ms "
        "(--grammar-mask-budget-ms)."
    )


def compile_failure(spec: StructuredOutputSpec, exc: BaseException) -> StructuredOutputError:
    """xgrammar's refusal of `spec` as the client's error (its first line says why)."""
    text = str(exc).strip()
    # xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:94: ": the reason is what follows.
    reason = re.sub(r"^\[[\d:]+\] \S+:\d+: ", "", text.splitlines()[0]) if text else type(exc).__name__
    return StructuredOutputError(f"The {label(spec.kind)} could not be compiled: {reason}")
