"""The records that cross between the engine's stages.

`SchedulerOutput` (scheduler -> model runner) and `RunnerOutput` (model runner -> scheduler) are the only
things that cross between scheduling and execution. `RequestOutput` is what `AsyncEngine.generate` yields to
the server. All are plain dataclasses: no tensors, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from engine.sampling_params import SamplingParams


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one chosen token plus the top alternatives at that position."""

    token_id: int
    logprob: float
    # (token_id, logprob) pairs, most likely first; len == the requested number of top logprobs.
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(slots=True)
class ScheduledRequest:
    """One request's share of a step.

    The runner computes `new_token_ids`, which sit at positions
    `num_computed_tokens .. num_computed_tokens + len(new_token_ids) - 1` of the request's sequence, writes their
    K/V into the slots given by `block_ids`, and attends over the whole context
    (`num_computed_tokens + len(new_token_ids)` tokens) through `block_ids`.
    """

    request_id: str
    new_token_ids: list[int]
    num_computed_tokens: int  # tokens already in the KV cache (cached hit or computed in earlier steps)
    block_ids: list[int]  # the request's whole block table; covers every token up to the end of this chunk
    # True when this chunk ends at the last known token: the runner samples one token for this request.
    # False for a non-final chunk of a chunked prefill (no logits needed).
    sample: bool
    sampling_params: SamplingParams
    # The request's whole sequence so far (prompt + generated), for penalties and seeded sampling.
    # A reference to the request's own list: the runner must not mutate it.
    all_token_ids: list[int]
    num_prompt_tokens: int
    # Number of tokens this request has generated so far (its seeded generator's position).
    num_output_tokens: int
    # The request's `engine.structured_output.GrammarState` (its own object: the sampler reads its mask, the
    # request advances it); None for an unconstrained request.
    grammar: Any = None
    # Speculative drafts (engine.spec_decode): the last len(draft_token_ids) of new_token_ids are guesses of
    # the tokens after the last known one. The runner samples at every one of those positions and keeps the
    # drafts the model agrees with (engine.spec_verify); they are not in all_token_ids.
    draft_token_ids: list[int] = field(default_factory=list)
    # The request's LoRA adapter (engine.lora.manager.LoRAAdapter), None for the base model: the runner adds
    # its deltas to this request's rows.
    lora: Any = None
    # The engine's one EOS set (the scheduler's, from `engine.tokenizer.Tokenizer.eos_token_ids`): the
    # tokens that end this request, which the sampler masks while it is short of min_tokens. One set for
    # both, so a token can never be masked as an EOS yet not stop, nor stop yet slip through min_tokens.
    eos_token_ids: frozenset[int] = frozenset()
    # Kept logits (engine.kept_logits). `kept_logits`: the key of the logits after this request's last token,
    # kept from an earlier step; its every token's KV is cached, so nothing is computed (new_token_ids is
    # empty) and the runner samples from the kept row. `keep_logits`: (key, owner) under which the runner
    # keeps the logits it computes after this chunk's last token (a prompt's end), for such a request later.
    kept_logits: bytes | None = None
    keep_logits: tuple[bytes, Any] | None = None


@dataclass(slots=True)
class SchedulerOutput:
    scheduled: list[ScheduledRequest]
    num_batched_tokens: int  # sum of len(new_token_ids)
    # (source, destination) KV blocks to copy, in every layer, before the step writes any KV: reading every
    # source before writing any destination (kv_cache.manager: the tail of a prefix hit).
    block_copies: list[tuple[int, int]] = field(default_factory=list)

    def decode_only(self) -> bool:
        """Whether every scheduled request computes just its last known token (and its drafts, if any): a
        decode step, no prefill chunk and no kept-logits row in it."""
        return bool(self.scheduled) and all(
            sr.sample and len(sr.new_token_ids) == 1 + len(sr.draft_token_ids) for sr in self.scheduled
        )


@dataclass(slots=True)
class RunnerOutput:
    # request_id -> sampled token, only for scheduled requests whose `sample` was True.
    sampled_token_ids: dict[str, int]
    # request_id -> logprob record of the sampled token, only where sampling_params.logprobs is not None.
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    # request_id -> logprob records for the prompt tokens computed in this step, for requests with
    # sampling_params.prompt_logprobs set. Entry i is for the token at position num_computed_tokens + i + 1
    # (the logprob of the *next* prompt token given the prefix); the first prompt token has none.
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
    # request_id -> why this request failed in the step (token ids outside the vocabulary, nothing left to
    # sample): the scheduler fails it alone, frees its blocks, and the batch goes on.
    errors: dict[str, str] = field(default_factory=dict)
    # request_id -> what a request with drafts emits (instead of sampled_token_ids / logprobs for it).
    verified: dict[str, VerifiedDrafts] = field(default_factory=dict)


@dataclass(slots=True)
class VerifiedDrafts:
    """The outcome of verifying one request's drafts (engine.spec_verify.accept)."""

    # The accepted drafts, then the model's own next token (left out when it could not be sampled: the next
    # step samples that position again and fails the request there).
    token_ids: list[int]
    logprobs: list[TokenLogprob] | None  # one per token, when sampling_params.logprobs is set
    num_accepted: int  # how many drafts were kept


class FinishReason(str, Enum):
    STOP = "stop"
    LENGTH = "length"
    ABORT = "abort"
    ERROR = "error"


@dataclass(slots=True)
class CompletionOutput:
    """What one of a request's n sequences produced since the previous yield (delta)."""

    index: int
    text: str  # new text since the previous yield (stop strings removed, partial matches held back)
    token_ids: list[int]  # new token ids since the previous yield
    logprobs: list[TokenLogprob] | None  # one per new token when logprobs were asked, else None
    finish_reason: FinishReason | None  # set on the sequence's last output
    stop_reason: int | str | None = None  # the stop string or stop token id that ended it, if any
    num_output_tokens: int = 0  # total generated by this sequence so far


@dataclass(slots=True)
class RequestOutput:
    """Yielded by `AsyncEngine.generate`: one or more sequences' deltas for one request."""

    request_id: str
    outputs: list[CompletionOutput]
    prompt_token_ids: list[int]
    num_cached_tokens: int  # prompt tokens served from the prefix cache (first scheduling)
    finished: bool  # True on the last output: every sequence has finished
    prompt_logprobs: list[TokenLogprob | None] | None = None  # set on the first output when asked for
    error: str | None = None  # set when the request failed inside the engine
