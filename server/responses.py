"""Building OpenAI response objects (plain dicts) from engine outputs: usage, logprobs, ids.

Dicts rather than pydantic models because the schema mixes fields that must be present-but-null
(`message.content`, `choices[].logprobs`, stream `finish_reason`) with fields that must be absent rather than
null (`usage` on ordinary chunks, `tool_calls`); spelling each object out keeps that exact.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

from engine.outputs import FinishReason, TokenLogprob
from server.engine_client import TokenizerLike


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def now() -> int:
    return int(time.time())


def finish_reason(reason: FinishReason | None) -> str | None:
    """The OpenAI finish reason; abort and error never reach a client as a finish reason (the client of an
    aborted request is gone, and an error is reported as an error)."""
    if reason is None:
        return None
    return "length" if reason == FinishReason.LENGTH else "stop"


def usage(num_prompt_tokens: int, num_completion_tokens: int, num_cached_tokens: int) -> dict[str, Any]:
    return {
        "prompt_tokens": num_prompt_tokens,
        "completion_tokens": num_completion_tokens,
        "total_tokens": num_prompt_tokens + num_completion_tokens,
        # Always reported, 0 included: clients read it to see whether the prefix cache helped.
        "prompt_tokens_details": {"cached_tokens": max(num_cached_tokens, 0)},
    }


class TokenTexts:
    """Decoded text of single tokens, cached: logprobs decode up to 21 tokens per generated token."""

    def __init__(self, tokenizer: TokenizerLike) -> None:
        # token_to_str keeps special tokens (decode() may skip them, which would show "" for EOS).
        self._decode_one = tokenizer.token_to_str
        self._cache: dict[int, str] = {}

    def __call__(self, token_id: int) -> str:
        text = self._cache.get(token_id)
        if text is None:
            text = self._decode_one(token_id)
            if len(self._cache) < 200_000:
                self._cache[token_id] = text
        return text


def _finite(logprob: float) -> float:
    # JSON has no -inf; OpenAI documents -9999.0 for "very unlikely".
    return logprob if logprob > -9999.0 else -9999.0


def chat_logprobs(records: list[TokenLogprob], texts: TokenTexts) -> list[dict[str, Any]]:
    """`ChatCompletionTokenLogprob` objects, one per generated token."""
    out = []
    for rec in records:
        token = texts(rec.token_id)
        out.append(
            {
                "token": token,
                "logprob": _finite(rec.logprob),
                "bytes": list(token.encode("utf-8")),
                "top_logprobs": [
                    {"token": (t := texts(tid)), "logprob": _finite(lp), "bytes": list(t.encode("utf-8"))}
                    for tid, lp in rec.top
                ],
            }
        )
    return out


class CompletionLogprobs:
    """Accumulates the legacy completions `logprobs` object (tokens, token_logprobs, top_logprobs,
    text_offset) for one choice, keeping `text_offset` running across streamed chunks."""

    def __init__(self, texts: TokenTexts, start_offset: int = 0) -> None:
        self._texts = texts
        self.offset = start_offset

    def build(self, records: list[TokenLogprob | None], token_ids: list[int]) -> dict[str, Any]:
        tokens: list[str] = []
        token_logprobs: list[float] = []
        top_logprobs: list[dict[str, float]] = []
        text_offset: list[int] = []
        for i, token_id in enumerate(token_ids):
            rec = records[i] if i < len(records) else None
            token = self._texts(token_id)
            tokens.append(token)
            text_offset.append(self.offset)
            self.offset += len(token)
            if rec is None:
                # The first prompt token has no logprob (nothing precedes it). The schema and the SDK's strict
                # types allow only numbers here, and dropping the entry would shift every index against
                # `tokens`, so it is reported as given: log P = 0.
                token_logprobs.append(0.0)
                top_logprobs.append({token: 0.0})
                continue
            token_logprobs.append(_finite(rec.logprob))
            top = {self._texts(tid): _finite(lp) for tid, lp in rec.top}
            top.setdefault(token, _finite(rec.logprob))  # the sampled token is always listed
            top_logprobs.append(top)
        return {
            "tokens": tokens,
            "token_logprobs": token_logprobs,
            "top_logprobs": top_logprobs,
            "text_offset": text_offset,
        }
