"""How a request wants its tokens chosen and when it stops.

The server validates user input and turns it into a `SamplingParams`; `validate()` is the engine's own
last line of defence and raises `ValueError` (which the server maps to a 400), never `AssertionError`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from engine.structured_spec import StructuredOutputSpec

_GREEDY_EPS = 1e-5
# A positive logit is divided by the penalty, a negative one multiplied: in float32, 1e-300 is 0 (x / 0 = inf,
# then a NaN softmax) and 1e39 is inf. This range keeps every penalised logit within a factor of 100 of the
# model's, far from overflow at any temperature the server accepts, and covers every setting in use (1.0-1.5,
# below 1 to favour repetition).
REPETITION_PENALTY_RANGE = (0.01, 100.0)


@dataclass(slots=True)
class SamplingParams:
    n: int = 1
    max_tokens: int | None = 16  # None: up to the model's context length
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 or -1: disabled
    min_p: float = 0.0
    seed: int | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    min_tokens: int = 0
    logprobs: int | None = None  # None: no logprobs; k >= 0: the sampled token's logprob plus top k
    prompt_logprobs: int | None = None  # same, for prompt tokens (completions echo + logprobs)
    include_stop_str_in_output: bool = False
    # Constrains the output (JSON schema, regex, ...): compiled by AsyncEngine.generate off the engine thread.
    structured: StructuredOutputSpec | None = None
    # Cache retention (kv_cache.retention): keep the KV blocks of the first `retention_tokens` prompt tokens
    # (None: the whole prompt) in the pool for `retention_s` seconds after their last hit; 0: no retention.
    # Here rather than beside the namespace because it travels the same hops from the server as the params.
    retention_s: float = 0.0
    retention_tokens: int | None = None
    # stop_token_ids as a set, built once per request (each of n children builds its own, once): the scheduler
    # tests every sampled token against it and the sampler masks it while min_tokens holds, so a list would
    # cost its length per token per sequence.
    stop_token_set: frozenset[int] = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        self.stop_token_set = frozenset(self.stop_token_ids)

    @property
    def greedy(self) -> bool:
        return self.temperature < _GREEDY_EPS

    def validate(self) -> None:
        for name in ("temperature", "top_p", "min_p", "presence_penalty", "frequency_penalty"):
            if not math.isfinite(getattr(self, name)):  # NaN passes every comparison below
                raise ValueError(f"{name} must be a finite number, got {getattr(self, name)}")
        if self.n < 1:
            raise ValueError(f"n must be at least 1, got {self.n}")
        if not math.isfinite(self.retention_s) or self.retention_s < 0:
            raise ValueError(f"retention_s must be a finite number >= 0, got {self.retention_s}")
        if self.max_tokens is not None and self.max_tokens < 1:
            raise ValueError(f"max_tokens must be at least 1, got {self.max_tokens}")
        if self.temperature < 0:
            raise ValueError(f"temperature must be non-negative, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {self.top_k}")
        if not 0 <= self.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if not -2 <= self.presence_penalty <= 2:
            raise ValueError(f"presence_penalty must be in [-2, 2], got {self.presence_penalty}")
        if not -2 <= self.frequency_penalty <= 2:
            raise ValueError(f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}")
        lo, hi = REPETITION_PENALTY_RANGE
        if not lo <= self.repetition_penalty <= hi:
            raise ValueError(f"repetition_penalty must be in [{lo}, {hi}], got {self.repetition_penalty}")
        if self.min_tokens < 0:
            raise ValueError(f"min_tokens must be non-negative, got {self.min_tokens}")
        if self.max_tokens is not None and self.min_tokens > self.max_tokens:
            raise ValueError("min_tokens must not exceed max_tokens")
        for name, k in (("logprobs", self.logprobs), ("prompt_logprobs", self.prompt_logprobs)):
            if k is not None and not 0 <= k <= 20:
                raise ValueError(f"{name} must be between 0 and 20, got {k}")
