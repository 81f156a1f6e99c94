"""How much one request may ask for: stop strings, stop token ids, logit_bias entries, prompts, sequences,
token ids to detokenize.

Each limit is a `brine serve` flag; the defaults are OpenAI's where OpenAI has a limit (4 stop strings, n at
most 128, which `server.protocol` enforces) and generous but bounded elsewhere. A request over a limit is a 400
naming the parameter (`code: array_above_max_length` / `string_above_max_length`, as OpenAI words them).

The checks run first in the generation routes, before any prompt is tokenized or anything reaches the engine
(the body itself is bounded by the 16 MiB cap, `server.body_limit`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from server.errors import bad_request
from server.protocol import ChatCompletionRequest, CompletionRequest

_ARRAY_CODE = "array_above_max_length"
_STRING_CODE = "string_above_max_length"


@dataclass(slots=True, frozen=True)
class RequestLimits:
    max_stop_strings: int = 4  # OpenAI's limit
    max_stop_string_chars: int = 1024
    max_stop_token_ids: int = 256
    max_logit_bias: int = 1024
    # Generation requests one namespace may have running or queued at once (server.inflight); 0: no cap.
    max_requests_per_namespace: int = 256
    max_prompts: int = 128  # prompts in one /v1/completions request
    max_seqs_per_request: int = 256  # prompts x n: the sequences one request makes the engine run
    max_detokenize_tokens: int = 32768  # token ids in one /detokenize body (4x the default model's context)


def check_limits(req: ChatCompletionRequest | CompletionRequest, limits: RequestLimits) -> None:
    """Raises a 400 naming the first parameter over its limit."""
    stops = [req.stop] if isinstance(req.stop, str) else req.stop or []
    _check_count("stop", stops, limits.max_stop_strings)
    for s in stops:
        if isinstance(s, str) and len(s) > limits.max_stop_string_chars:
            raise bad_request(
                f"Invalid 'stop': each stop string may be at most {limits.max_stop_string_chars} characters "
                "long.",
                "stop",
                _STRING_CODE,
            )
    _check_count("stop_token_ids", req.stop_token_ids, limits.max_stop_token_ids)
    _check_count("logit_bias", req.logit_bias, limits.max_logit_bias)
    prompt = req.prompt if isinstance(req, CompletionRequest) else None
    # A flat list of token ids is one prompt; any other list is one prompt per item.
    num_prompts = len(prompt) if isinstance(prompt, list) and prompt and not _is_int(prompt[0]) else 1
    if num_prompts > limits.max_prompts:
        raise bad_request(
            f"Invalid 'prompt': at most {limits.max_prompts} prompts per request, got {num_prompts}.",
            "prompt",
            _ARRAY_CODE,
        )
    n = req.n or 1
    if num_prompts * n > limits.max_seqs_per_request:
        raise bad_request(
            f"Invalid 'n': this request asks for {num_prompts * n} sequences ({num_prompts} prompt(s) x n={n}); "
            f"at most {limits.max_seqs_per_request} are allowed per request.",
            "n",
            _ARRAY_CODE,
        )


def _check_count(param: str, value: Any, limit: int) -> None:
    if isinstance(value, (list, dict)) and len(value) > limit:
        kind = "object with at most" if isinstance(value, dict) else "array with at most"
        raise bad_request(
            f"Invalid '{param}': expected an {kind} {limit} entries, got {len(value)}.", param, _ARRAY_CODE
        )


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)
