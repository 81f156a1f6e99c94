"""What a structured-output request asks for, and the errors it can meet: the records every layer that
carries a constraint shares (the server builds a `StructuredOutputSpec`, `SamplingParams` holds it, the compiler
and the sandbox compile it), kept apart from the grammar engine so that holding a spec imports nothing.

Imports nothing of the engine: everything about grammars points down to here (engine.grammar_compile,
engine.grammar_sandbox, engine.structured_output, engine.grammar_masks).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

KINDS = ("json_object", "json_schema", "regex", "choice", "grammar")

# How a sequence failed by its grammar's mask cost reads in `RequestOutput.error`, and how the server knows it
# (the error crosses the engine as text): the client's grammar is the cause, so the client is told so.
MASK_BUDGET_ERROR = "The output constraint's grammar exceeded this server's per-token mask budget"


@dataclass(frozen=True, slots=True)
class StructuredOutputSpec:
    """What a request's output must match. `kind` is one of KINDS; `spec` is the canonical text (JSON of the
    schema with sorted keys, the regex, JSON of the choice list, the EBNF grammar); with the request's cache
    namespace, the cache key."""

    kind: str
    spec: str = ""


class StructuredOutputError(ValueError):
    """A constraint the grammar engine cannot compile or follow: the client's to fix (a 400 naming `param`)."""

    def __init__(self, message: str, param: str = "response_format") -> None:
        super().__init__(message)
        self.param = param


class GrammarTooSlowError(RuntimeError):
    """A request's grammar masks went over the per-token budget: that request fails, the batch goes on. Its
    repr is its message, which starts with MASK_BUDGET_ERROR: the scheduler records a failure as the
    exception's repr, and that text is what reaches the server."""

    def __init__(self, spent_s: float, budget_s: float, sequences: int) -> None:
        across = f" across its {sequences} sequences" if sequences > 1 else ""
        super().__init__(
            f"{MASK_BUDGET_ERROR}: its masks cost {spent_s * 1e3:.1f} ms of CPU per token{across}, over the "
            f"budget of {budget_s * 1e3:g} ms (--grammar-mask-budget-ms)."
        )

    def __repr__(self) -> str:
        return str(self)


def is_mask_budget_error(error: str | None) -> bool:
    """True for a `RequestOutput.error` that a grammar over the mask budget caused."""
    return error is not None and error.startswith(MASK_BUDGET_ERROR)


def schema_text(schema: dict[str, Any]) -> str:
    """A JSON schema's canonical text, the `spec` of a json_schema spec: the same schema sent with its keys in
    another order is the same spec (one cache entry; an operator's public schema matches it)."""
    return json.dumps(schema, sort_keys=True, ensure_ascii=False)


def label(kind: str) -> str:
    """A spec kind as an error message names it."""
    return {"json_schema": "JSON schema", "json_object": "JSON object grammar", "regex": "regex"}.get(
        kind, kind
    )
