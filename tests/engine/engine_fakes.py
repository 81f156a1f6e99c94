"""Test doubles for the engine: a fake model runner with a simulated paged KV cache, and a byte tokenizer.

`FakeRunner` behaves like the real runner where it matters to the scheduler: it writes every scheduled
token into its slot (`block_id * block_size + offset`) for the whole batch first, then reads each request's
context back *through the block table* and derives the next token from what it read. So a wrong prefix hit,
a block reused while still in use, or a block table that misses a token changes the output (and trips the
assertion that the context read back equals the request's real tokens).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from engine.config import EngineConfig
from engine.engine_core import EngineCore
from engine.outputs import RequestOutput, RunnerOutput, SchedulerOutput, TokenLogprob
from metrics.stats import StatLogger

NextToken = Callable[[list[int], int, int | None], int]  # (context, num_prompt_tokens, seed) -> token


def hash_next_token(context: list[int], num_prompt_tokens: int, seed: int | None) -> int:
    """Deterministic 'model': a function of the whole context (and the seed), in 10..209 (never EOS)."""
    h = (seed or 0) * 1_000_003
    for t in context:
        h = (h * 31 + t + 7) % 1_000_000_007
    return 10 + h % 200


def scripted(text: str, then: int = 0) -> NextToken:
    """Outputs the UTF-8 bytes of `text` one per step (byte tokenizer ids), then `then` forever."""
    data = text.encode()

    def next_token(context: list[int], num_prompt_tokens: int, seed: int | None) -> int:
        i = len(context) - num_prompt_tokens
        return data[i] if i < len(data) else then

    return next_token


@dataclass
class FakeRunner:
    num_blocks: int = 64
    block_size: int = 4
    max_model_len: int = 1024
    is_causal: bool = True
    next_token: NextToken = hash_next_token
    fail_on_step: int | None = None  # raise from execute() on this step (fatal-error tests)
    drop_token_for: set[str] = field(default_factory=set)  # request ids that get no sampled token
    step_delay: float = 0.0  # seconds per execute(), so that async tests can act while requests run
    slots: dict[int, int] = field(default_factory=dict)
    steps: list[SchedulerOutput] = field(default_factory=list)

    def execute(self, out: SchedulerOutput) -> RunnerOutput:
        if self.fail_on_step is not None and len(self.steps) == self.fail_on_step:
            raise RuntimeError("simulated device failure")
        self.steps.append(out)
        if self.step_delay:
            time.sleep(self.step_delay)
        bs = self.block_size
        assert out.num_batched_tokens == sum(len(s.new_token_ids) for s in out.scheduled)
        # Block copies first, every source read before any destination is written (as KVStore.copy_blocks).
        copied = {
            dst * bs + i: self.slots[src * bs + i]
            for src, dst in out.block_copies
            for i in range(bs)
            if src * bs + i in self.slots
        }
        for _, dst in out.block_copies:
            for i in range(bs):
                self.slots.pop(dst * bs + i, None)
        self.slots.update(copied)
        for s in out.scheduled:  # write K/V of the whole batch before any "attention"
            for i, tok in enumerate(s.new_token_ids):
                pos = s.num_computed_tokens + i
                self.slots[s.block_ids[pos // bs] * bs + pos % bs] = tok
        result = RunnerOutput({})
        for s in out.scheduled:
            end = s.num_computed_tokens + len(s.new_token_ids)
            context = [self.slots.get(s.block_ids[p // bs] * bs + p % bs, -1) for p in range(end)]
            assert context == s.all_token_ids[:end], f"{s.request_id}: KV cache holds the wrong tokens"
            if s.sample and s.request_id not in self.drop_token_for:
                tok = self.next_token(context, s.num_prompt_tokens, s.sampling_params.seed)
                result.sampled_token_ids[s.request_id] = tok
                if s.sampling_params.logprobs is not None:
                    result.logprobs[s.request_id] = TokenLogprob(tok, -0.5, [(tok, -0.5)])
            if s.sampling_params.prompt_logprobs is not None:
                entries = [
                    TokenLogprob(s.all_token_ids[p + 1], -1.0 - p)
                    for p in range(s.num_computed_tokens, end)
                    if p + 1 < len(s.all_token_ids)
                ]
                result.prompt_logprobs[s.request_id] = entries
        return result


class ByteTokenizer:
    """Token id == byte value (0..255); EOS is 0. Decoding replaces incomplete UTF-8 with U+FFFD, as real
    byte-level BPE tokenizers do."""

    eos_token_ids = frozenset({0})

    def __init__(self) -> None:
        self.forgotten: list[object] = []  # forget_pieces' owners, in order

    def encode(self, text: str) -> list[int]:
        return list(text.encode())

    def forget_pieces(self, owner: object = None) -> None:
        self.forgotten.append(owner)

    def decode(self, token_ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        ids = [t for t in token_ids if not (skip_special_tokens and t == 0)]
        return bytes(t % 256 for t in ids).decode("utf-8", errors="replace")


@dataclass
class RecordingLogger(StatLogger):
    records: list = field(default_factory=list)

    def record(self, scheduler_stats, iteration_stats) -> None:
        self.records.append((scheduler_stats, iteration_stats))


def make_core(runner: FakeRunner | None = None, *, kv_event_sink=None, **config) -> EngineCore:
    """`config`: EngineConfig fields."""
    return EngineCore(
        runner or FakeRunner(), ByteTokenizer(), EngineConfig(**config), kv_event_sink=kv_event_sink
    )


def run_to_completion(core: EngineCore, max_steps: int = 10_000) -> list[RequestOutput]:
    """Steps until idle, checking the KV cache's invariants after every step."""
    outputs: list[RequestOutput] = []
    for _ in range(max_steps):
        if not core.has_work():
            break
        outputs += core.step()
        core.kv_manager.check_invariants()
    else:
        raise AssertionError("the engine did not go idle")
    assert core.kv_manager.num_free_blocks == core.kv_manager.num_blocks, "blocks leaked"
    return outputs


def collect(outputs: list[RequestOutput], request_id: str) -> dict[int, dict]:
    """Per sequence index: concatenated text, all token ids, finish reason, stop reason."""
    seqs: dict[int, dict] = {}
    for out in outputs:
        if out.request_id != request_id:
            continue
        for c in out.outputs:
            s = seqs.setdefault(
                c.index, {"text": "", "token_ids": [], "finish_reason": None, "stop_reason": None}
            )
            s["text"] += c.text
            s["token_ids"] += c.token_ids
            if c.finish_reason is not None:
                s["finish_reason"], s["stop_reason"] = c.finish_reason, c.stop_reason
    return seqs
