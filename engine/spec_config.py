"""`SpeculativeConfig`: the `--speculative-config` JSON (vLLM's shape), parsed and checked once.

    {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 4, "prompt_lookup_min": 2}

Only prompt lookup ("ngram") exists: drafts come from the request's own tokens (engine.ngram_proposer), so
no draft model is loaded and nothing is shared between requests. Brine adds two keys of its own, both about
when speculation backs off for the whole step (engine.spec_decode), measured on CPU in
docs/speculative-decoding.md:
`disable_by_batch_size` (vLLM's name: no drafts in a step once this many sequences run) and
`max_draft_tokens_per_step` (the drafts of one step together, so a batch whose step is compute-bound does not
pay for drafts it cannot afford); and one about each request's drafts: `min_draft_acceptance`, the least
chance of being accepted that a request's first draft token must have (from the request's record) to be
drafted (later ones need more: engine.spec_decode.SpecDecoder.num_drafts), which is what a draft row costs over
what a sequence's row of the step costs: "auto" (the default, also null) measures
that from the engine's own steps (engine.spec_cost), a number fixes it. Stdlib only: `brine --help` imports
this.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

MAX_SPECULATIVE_TOKENS = 16  # past this a rejected draft costs more than any acceptance wins on CPU
MAX_LOOKUP = 64
DEFAULT_LOOKUP_MAX = 4
DEFAULT_LOOKUP_MIN = 2


@dataclass(slots=True, frozen=True)
class SpeculativeConfig:
    method: str = "ngram"
    num_speculative_tokens: int = 4  # K: the most drafts a request verifies in one step
    prompt_lookup_max: int = (
        DEFAULT_LOOKUP_MAX  # the longest suffix n-gram looked up in the request's own tokens
    )
    prompt_lookup_min: int = DEFAULT_LOOKUP_MIN  # the shortest one that may propose a draft
    disable_by_batch_size: int = 32
    # A token less likely than what a draft row costs over a sequence's decode row to be accepted costs more
    # than it saves. None ("auto"): that cost as measured from this engine's steps (engine.spec_cost), since it
    # ranges from ~0.07 to ~0.5 with the CPU and the batch size (benchmarks/spec_step_cost.py).
    min_draft_acceptance: float | None = None
    max_draft_tokens_per_step: int = 128
    # Drafts in a step that also prefills, or while prompts wait: off, since the drafts take the prefills'
    # token budget (16 free-text streams took more steps with them). Tests turn it on to draft under preemption.
    draft_beside_prefill: bool = False

    @classmethod
    def from_json(cls, text: str) -> SpeculativeConfig:
        """Parses the flag's JSON; ValueError naming the key for anything wrong."""
        try:
            raw = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"not JSON: {exc}") from None
        if not isinstance(raw, dict):
            raise ValueError("must be a JSON object")
        return cls.from_dict(raw)

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> SpeculativeConfig:
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise ValueError(f"unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        if raw.get("method", "ngram") != "ngram":
            raise ValueError(f"method {raw.get('method')!r} is not supported; only 'ngram' (prompt lookup)")
        values = dict(raw)
        for name in sorted(known - {"method", "draft_beside_prefill", "min_draft_acceptance"}):
            if name in values and (not isinstance(values[name], int) or isinstance(values[name], bool)):
                raise ValueError(f"{name} must be an integer, got {values[name]!r}")
        if "min_draft_acceptance" in values:
            floor = values["min_draft_acceptance"]
            if floor is None or floor == "auto":
                values["min_draft_acceptance"] = None
            elif not isinstance(floor, (int, float)) or isinstance(floor, bool):
                raise ValueError(f'min_draft_acceptance must be a number or "auto", got {floor!r}')
            else:
                values["min_draft_acceptance"] = float(floor)
        if not isinstance(values.get("draft_beside_prefill", False), bool):
            raise ValueError(
                f"draft_beside_prefill must be true or false, got {values['draft_beside_prefill']!r}"
            )
        # One bound given alone moves the other's default out of its way.
        if "prompt_lookup_min" in values and "prompt_lookup_max" not in values:
            values["prompt_lookup_max"] = max(values["prompt_lookup_min"], DEFAULT_LOOKUP_MAX)
        if "prompt_lookup_max" in values and "prompt_lookup_min" not in values:
            values["prompt_lookup_min"] = min(values["prompt_lookup_max"], DEFAULT_LOOKUP_MIN)
        config = cls(**values)
        config.validate()
        return config

    def validate(self) -> None:
        if not 1 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be 1..{MAX_SPECULATIVE_TOKENS}, got {self.num_speculative_tokens}"
            )
        if not 1 <= self.prompt_lookup_min <= self.prompt_lookup_max <= MAX_LOOKUP:
            raise ValueError(
                f"need 1 <= prompt_lookup_min <= prompt_lookup_max <= {MAX_LOOKUP}, got "
                f"{self.prompt_lookup_min} and {self.prompt_lookup_max}"
            )
        if self.min_draft_acceptance is not None and not 0.0 <= self.min_draft_acceptance < 1.0:
            raise ValueError(f"min_draft_acceptance must be in [0, 1), got {self.min_draft_acceptance}")
        if self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be at least 1, got {self.disable_by_batch_size}")
        if self.max_draft_tokens_per_step < 1:
            raise ValueError(
                f"max_draft_tokens_per_step must be at least 1, got {self.max_draft_tokens_per_step}"
            )
