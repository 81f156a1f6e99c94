"""One sequence the engine is producing: its tokens, how far its KV cache has been computed, its status.

A `Request` satisfies `kv_cache.CacheRequest`: the KV cache manager reads `all_token_ids`,
`num_computed_tokens`, `block_hashes`, `skip_reading_prefix_cache` and `num_preemptions` from it. The
scheduler is the only writer of `num_computed_tokens` and `status` (a sequence the output processor ends, the
engine finishes through `Scheduler.finish`); `append_output_token` is the only way tokens grow, so `block_hashes` never falls
behind the tokens.

With `n > 1` the engine makes n `Request`s (one per sequence); each is scheduled on its own and they meet
again only through the prefix cache.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any

from engine.outputs import FinishReason, TokenLogprob
from engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from engine.structured_output import GrammarState
    from kv_cache.hashing import BlockHash, BlockHasher
    from kv_cache.namespace import CacheNamespace


class RequestStatus(Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"  # waiting again after its blocks were taken; will be recomputed
    LOADING = "loading"  # its cached prefix is being loaded from a KV tier (engine.kv_tiers)
    FINISHED_STOPPED = "finished_stopped"
    FINISHED_LENGTH = "finished_length"
    FINISHED_ABORTED = "finished_aborted"
    FINISHED_ERROR = "finished_error"

    @property
    def is_finished(self) -> bool:
        return self in _FINISH_REASONS

    @property
    def finish_reason(self) -> FinishReason | None:
        return _FINISH_REASONS.get(self)


_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: FinishReason.STOP,
    RequestStatus.FINISHED_LENGTH: FinishReason.LENGTH,
    RequestStatus.FINISHED_ABORTED: FinishReason.ABORT,
    RequestStatus.FINISHED_ERROR: FinishReason.ERROR,
}


def fair_share_key(namespace: CacheNamespace | None, group: str) -> str:
    """Whom the scheduler shares fairly between (engine policy, so computed here from the namespace, never by
    the caller): the tenant, else the trusted gateway's value, else the salt, so that a flood under one
    namespace shares one fair share however many requests it sends; with no namespace, `group` (the API
    request: all its prompts and n sequences together). The tenant wins over the salt, so a tenant cannot
    buy more shares by rotating salts; with salt-only tenancy a client that rotates salts does get more.
    The kinds are prefixed, so a salt can never take a tenant's share. The order is `CacheNamespace.holder`'s,
    which the pool's retention and the responses store share by too."""
    if namespace is None:
        return group
    kind, value = namespace.holder
    return group if value is None else f"{kind}:{value}"


@dataclass(frozen=True, slots=True)
class Origin:
    """Where a request comes from: the one record about it that travels from the server to `Request`.

    `namespace`: whose cache it may read and write (tenant, gateway value, salt, LoRA adapter; None: the
    shared unsalted namespace). `group`: the API request it is part of, whose prompts share one fair share
    where there is no namespace (None: the engine request alone, all its n sequences). The engine derives the
    rest from it: block hashes, the LoRA adapter, the compiled-grammar cache's key, the fair share
    (`fair_share_key`). Never logged: it may name a tenant or salt."""

    namespace: CacheNamespace | None = None
    group: str | None = None


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Whose cache this request may read and write (tenant, gateway header, cache_salt); None: unsalted.
    namespace: CacheNamespace | None = None
    # Made by KVCacheManager.make_hasher; None when prefix caching is off (block_hashes then stays empty).
    hasher: BlockHasher | None = None
    arrival_time: float = field(default_factory=time.monotonic)
    # Which of the parent request's n sequences this is (CompletionOutput.index).
    index: int = 0
    # Whom the scheduler shares slots and tokens fairly between (`fair_share_key`): given, the API request's
    # id (every sequence of its prompts and n passes the same one; empty: this request's own id); then made
    # the namespace's key wherever the request has a namespace. Never logged: it may name a tenant or salt.
    owner: str = ""
    # Constrains the generated tokens (structured outputs); None: unconstrained. Advanced by every appended
    # output token, never by prompt tokens.
    grammar: GrammarState | None = None
    # The LoRA adapter it runs (engine.lora.manager.LoRAAdapter, resolved from namespace.lora when it was
    # added, and kept to its end: an unload does not take it away); None: the base model.
    lora: Any = None

    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(init=False)
    block_hashes: list[BlockHash] = field(default_factory=list)
    status: RequestStatus = RequestStatus.WAITING
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit (tokens) at first scheduling; -1 until then
    num_preemptions: int = 0
    stop_reason: int | str | None = None  # the stop token id / stop string that finished it
    error: str | None = None  # set with FINISHED_ERROR

    # Accumulated prompt logprobs (entry 0 is None: the first token has no context); None when not asked for.
    prompt_logprobs: list[TokenLogprob | None] | None = None

    # Timings (time.monotonic()) for the metrics.
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None

    def __post_init__(self) -> None:
        self.owner = fair_share_key(self.namespace, self.owner or self.request_id)
        # A copy: the caller's list must not grow with our outputs (n > 1 children share one prompt list).
        self.all_token_ids = list(self.prompt_token_ids)
        if self.sampling_params.prompt_logprobs is not None:
            self.prompt_logprobs = [None]
        self._update_block_hashes()

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def retention(self) -> tuple[float, int] | None:
        """(TTL seconds, prompt tokens) to retain in the KV pool (kv_cache.retention), or None."""
        p = self.sampling_params
        if p.retention_s <= 0:
            return None
        n = (
            self.num_prompt_tokens
            if p.retention_tokens is None
            else min(p.retention_tokens, self.num_prompt_tokens)
        )
        return p.retention_s, n

    @property
    def skip_reading_prefix_cache(self) -> bool:
        # Prompt logprobs need logits for every prompt position, so cached positions would leave holes.
        return self.sampling_params.prompt_logprobs is not None

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)
        if self.grammar is not None:
            self.grammar.accept(token_id)
        self._update_block_hashes()

    def truncate_output(self, num_output_tokens: int) -> None:
        """Drops the output tokens past the first `num_output_tokens` (speculation appended a few tokens in one
        step and a stop string ended the output among them): the request then looks as if it had stopped
        there. Only for a request being finished now, never one under a grammar (the matcher cannot go back),
        and before its blocks are freed, so that nothing past the stop gets cached."""
        drop = self.num_output_tokens - num_output_tokens
        if drop <= 0:
            return
        if self.grammar is not None:
            raise RuntimeError("a constrained request's output cannot be truncated")
        del self.output_token_ids[num_output_tokens:]
        del self.all_token_ids[self.num_prompt_tokens + num_output_tokens :]
        if self.hasher is not None:
            del self.block_hashes[self.num_tokens // self.hasher.block_size :]
        self.num_computed_tokens = min(self.num_computed_tokens, self.num_tokens - 1)

    def add_prompt_logprobs(self, start: int, entries: list[TokenLogprob]) -> None:
        """Records the prompt logprobs of a chunk that started at position `start` (entry i is for position
        start + i + 1). A recompute after preemption repeats positions we already have, and positions past the
        prompt are not prompt logprobs: both are dropped."""
        if self.prompt_logprobs is None:
            return
        for i, entry in enumerate(entries):
            pos = start + i + 1
            if pos == len(self.prompt_logprobs) and pos < self.num_prompt_tokens:
                self.prompt_logprobs.append(entry)

    def _update_block_hashes(self) -> None:
        # The hasher remembers nothing but len(block_hashes), so calling it per token costs one length check
        # until a block fills.
        if self.hasher is not None:
            self.hasher.extend(self.block_hashes, self.all_token_ids)
