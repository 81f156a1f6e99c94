"""A fake `AsyncEngine` for fast server tests: same surface and rules, no model.

What it keeps faithful to the agreed AsyncEngine contract:
- `generate()` is an async generator of `RequestOutput` deltas (one per step, every unfinished sequence of
  the request's n), the last with finished=True; ValueError before the first yield when prompt + max_tokens
  exceeds max_model_len (`ContextLengthError`) or the prompt can never fit the KV cache.
- Stop strings are removed from the text (partial matches held back), stop token ids / EOS end a sequence
  (respecting min_tokens and ignore_eos), max_tokens gives finish_reason LENGTH.
- KV accounting: a request holds ceil(tokens / block_size) blocks while it runs; full blocks are cached
  under (namespace, every token up to the block's end), so a hit needs the same namespace and the same whole
  prefix; `forget_prefix_cache(owner)` drops the blocks of namespaces with that owner (no public prefixes);
  a hit is capped at prompt_len - 1 and skipped when prompt logprobs are asked for.
- A consumer that stops iterating (aclose, cancellation) aborts the request and frees its blocks.
Generated text is deterministic: greedy or seeded requests with the same prompt produce the same text.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fake_tokenizer import EOS_ID, FakeTokenizer

from engine.async_engine import EngineDeadError
from engine.errors import ContextLengthError
from engine.outputs import CompletionOutput, FinishReason, RequestOutput, TokenLogprob
from engine.request import Origin
from engine.sampling_params import SamplingParams
from kv_cache.namespace import CacheNamespace, Owner

WORDS = ("alpha", "bravo", "charlie", "delta", "echo", "foxtrot", "golf", "hotel", "india", "juliet")


@dataclass(slots=True)
class GenerateCall:
    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    namespace: CacheNamespace | None
    owner: str | None = None

    @property
    def cache_salt(self) -> str | None:
        return self.namespace.salt if self.namespace is not None else None


@dataclass(slots=True)
class _Seq:
    index: int
    rng: random.Random
    token_ids: list[int] = field(default_factory=list)
    pending: str = ""  # the rest of the word being spelled out, one character per token
    text: str = ""  # decoded text so far, stop strings not yet removed
    sent: int = 0  # characters of `text` already yielded
    finish: FinishReason | None = None
    stop_reason: int | str | None = None


class FakeEngine:
    def __init__(
        self,
        *,
        model_name: str = "fake-model",
        max_model_len: int = 256,
        block_size: int = 4,
        num_blocks: int = 256,
        enable_prefix_caching: bool = True,
        eos_after: int | None = None,  # sample EOS as the nth token (None: never)
        step_delay: float = 0.0,
        error_after: int | None = None,  # fail the request with an error output after this many steps
        model_vocab_size: int | None = None,  # the model's vocabulary (default: the tokenizer's)
    ) -> None:
        self.tokenizer = FakeTokenizer()
        self.vocab_size = min(self.tokenizer.vocab_size, model_vocab_size or self.tokenizer.vocab_size)
        self.model_name = model_name
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.eos_after = eos_after
        self.step_delay = step_delay
        self.error_after = error_after
        self.healthy = True
        self.calls: list[GenerateCall] = []
        self.aborted: list[str] = []
        self._abort_flags: set[str] = set()
        self._held: dict[str, int] = {}  # request id -> blocks in use
        self._cached: set[tuple[CacheNamespace | None, tuple[int, ...]]] = set()
        self.running: set[str] = set()
        self.public_prefixes: list[list[int]] = []  # recorded only: the fake shares no public blocks

    # ---- the AsyncEngine surface ---------------------------------------------------------------------

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        origin: Origin | None = None,
    ) -> AsyncIterator[RequestOutput]:
        namespace = origin.namespace if origin is not None else None
        owner = origin.group if origin is not None else None
        if not self.healthy:
            raise EngineDeadError("fake engine is dead")
        params.validate()
        prompt = list(prompt_token_ids)
        max_tokens = params.max_tokens or (self.max_model_len - len(prompt))
        if len(prompt) + max_tokens > self.max_model_len:
            raise ContextLengthError(self.max_model_len, f"the request needs {len(prompt) + max_tokens}.")
        if -(-len(prompt) // self.block_size) > self.num_blocks:
            raise ValueError("the prompt can never fit the KV cache")
        rid = request_id or uuid.uuid4().hex
        self.calls.append(GenerateCall(prompt, params, rid, namespace, owner))
        cached = self._lookup(prompt, namespace, params)
        self.running.add(rid)
        self._held[rid] = self._blocks(len(prompt)) * params.n
        seqs = [_Seq(i, self._rng(prompt, params, i)) for i in range(params.n)]
        prompt_logprobs = self._prompt_logprobs(prompt, params)
        finished, step = False, 0
        try:
            while not finished:
                await asyncio.sleep(self.step_delay)
                step += 1
                self._held[rid] = sum(self._blocks(len(prompt) + len(s.token_ids) + 1) for s in seqs)
                if rid in self._abort_flags:
                    outs = [self._finish(s, FinishReason.ABORT) for s in seqs if s.finish is None]
                    finished = True
                    self.aborted.append(rid)
                    self._held.pop(rid, None)
                    yield RequestOutput(rid, outs, prompt, cached, True)
                    return
                if self.error_after is not None and step > self.error_after:
                    outs = [self._finish(s, FinishReason.ERROR) for s in seqs if s.finish is None]
                    finished = True
                    self._held.pop(rid, None)
                    yield RequestOutput(rid, outs, prompt, cached, True, error="fake engine failure")
                    return
                outs = [self._step(s, prompt, params, max_tokens) for s in seqs if s.finish is None]
                finished = all(s.finish is not None for s in seqs)
                if finished:  # blocks are freed in the step that finishes the request, as in the engine
                    self._release(rid, prompt, seqs, namespace)
                    self._held.pop(rid, None)
                    self.running.discard(rid)
                yield RequestOutput(
                    rid, outs, prompt, cached, finished, prompt_logprobs if step == 1 else None
                )
        finally:
            if not finished:
                self.aborted.append(rid)
            self._held.pop(rid, None)
            self.running.discard(rid)
            self._abort_flags.discard(rid)

    async def abort(self, request_id: str) -> None:
        if request_id in self.running:
            self._abort_flags.add(request_id)

    def is_healthy(self) -> bool:
        return self.healthy

    def reset_prefix_cache(self, force: bool = False) -> bool:
        if self._held and not force:
            return False
        self._cached.clear()
        return True

    def forget_prefix_cache(self, owner: Owner) -> int:
        mine = {key for key in self._cached if key[0] is not None and key[0].owner == owner}
        self._cached -= mine
        return len(mine)

    def set_public_prefixes(self, prefixes: list[list[int]]) -> None:
        self.public_prefixes = [list(p) for p in prefixes]

    def num_used_blocks(self) -> int:
        return sum(self._held.values())

    def kv_event_sources(self) -> dict[str, dict[str, Any]]:
        return {}

    def shutdown(self) -> None:
        self.healthy = False

    # ---- internals -----------------------------------------------------------------------------------

    def _blocks(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _lookup(self, prompt: list[int], salt: CacheNamespace | None, params: SamplingParams) -> int:
        if not self.enable_prefix_caching or params.prompt_logprobs is not None:
            return 0
        hit = 0
        while hit + self.block_size <= len(prompt) - 1:  # the last prompt token is always computed
            if (salt, tuple(prompt[: hit + self.block_size])) not in self._cached:
                break
            hit += self.block_size
        return hit

    def _release(self, rid: str, prompt: list[int], seqs: list[_Seq], salt: CacheNamespace | None) -> None:
        if not self.enable_prefix_caching:
            return
        for seq in seqs:
            tokens = prompt + seq.token_ids
            for end in range(self.block_size, len(tokens) + 1, self.block_size):
                self._cached.add((salt, tuple(tokens[:end])))

    def _rng(self, prompt: list[int], params: SamplingParams, index: int) -> random.Random:
        if params.greedy:
            return random.Random(hash(tuple(prompt)))
        if params.seed is not None:
            return random.Random(hash((tuple(prompt), params.seed + index)))
        return random.Random()

    def _step(
        self, seq: _Seq, prompt: list[int], params: SamplingParams, max_tokens: int
    ) -> CompletionOutput:
        n_out = len(seq.token_ids)
        if self.eos_after is not None and n_out + 1 >= self.eos_after:
            token = EOS_ID
        else:
            if not seq.pending:
                seq.pending = seq.rng.choice(WORDS) + " "
            token, seq.pending = self.tokenizer.encode(seq.pending[0])[0], seq.pending[1:]
        seq.token_ids.append(token)
        can_stop = len(seq.token_ids) > params.min_tokens
        if can_stop and token in params.stop_token_ids:
            self._finish(seq, FinishReason.STOP, token)
        elif can_stop and token == EOS_ID and not params.ignore_eos:
            self._finish(seq, FinishReason.STOP)
        elif token != EOS_ID:
            seq.text += self.tokenizer.decode([token])
            for stop in params.stop:
                at = seq.text.find(stop, max(0, seq.sent - len(stop)))
                if at >= 0 and can_stop:
                    seq.text = seq.text[: at + (len(stop) if params.include_stop_str_in_output else 0)]
                    self._finish(seq, FinishReason.STOP, stop)
                    break
        if seq.finish is None and len(seq.token_ids) >= max_tokens:
            self._finish(seq, FinishReason.LENGTH)
        # Hold back a tail that could still become a stop string.
        hold = 0
        if seq.finish is None:
            for stop in params.stop:
                for k in range(min(len(stop) - 1, len(seq.text)), 0, -1):
                    if seq.text.endswith(stop[:k]):
                        hold = max(hold, k)
                        break
        upto = max(seq.sent, len(seq.text) - hold)
        delta, seq.sent = seq.text[seq.sent : upto], upto
        logprobs = None
        if params.logprobs is not None:
            logprobs = [self._logprob(token, params.logprobs, n_out)]
        return CompletionOutput(
            seq.index, delta, [token], logprobs, seq.finish, seq.stop_reason, len(seq.token_ids)
        )

    def _finish(self, seq: _Seq, reason: FinishReason, stop_reason: Any = None) -> CompletionOutput:
        seq.finish, seq.stop_reason = reason, stop_reason
        return CompletionOutput(seq.index, "", [], None, reason, stop_reason, len(seq.token_ids))

    def _logprob(self, token: int, k: int, position: int) -> TokenLogprob:
        chosen = -0.25 - (position % 3) / 10
        top = [(token, chosen)] + [((token + j) % self.tokenizer.vocab_size, chosen - j) for j in range(1, k)]
        return TokenLogprob(token, chosen, top[:k])

    def _prompt_logprobs(self, prompt: list[int], params: SamplingParams) -> list[TokenLogprob | None] | None:
        if params.prompt_logprobs is None:
            return None
        k = params.prompt_logprobs
        return [None] + [self._logprob(t, k, i) for i, t in enumerate(prompt[1:], start=1)]
