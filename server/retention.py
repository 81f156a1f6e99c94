"""Retention requests from clients, turned into the engine's `SamplingParams.retention_s` / `retention_tokens`
(the KV pool keeps those blocks for the TTL, each hit refreshing it: `kv_cache.retention`):

- OpenAI's `prompt_cache_retention` on chat, completions and responses: "in_memory" (the default: no
  retention, the pool's LRU decides) or "24h" (the whole prompt, 24 hours);
- Anthropic-style `cache_control: {"type": "ephemeral", "ttl": "5m" | "1h"}` on a chat message's content part
  (OpenAI clients pass it through `extra_body`): the prompt up to the end of the last marked message, for the
  longest TTL asked (default 5m); the Messages API's own breakpoints use the same TTLs (server.serving_messages).

Anything else is a 400 naming the field. Retained blocks stay in the pool within `--max-retained-fraction`,
each cache namespace within its share of that.
"""

from __future__ import annotations

from typing import Any

from kv_cache.namespace import CacheNamespace
from server.engine_client import EngineClient
from server.errors import bad_request
from server.prompts import off_loop, render_chat
from server.protocol import ChatCompletionRequest

PROMPT_CACHE_RETENTION_S = {"in_memory": 0.0, "24h": 24 * 3600.0}
CACHE_CONTROL_TTL_S = {"5m": 300.0, "1h": 3600.0}


def retention_seconds(value: str | None) -> float:
    """`prompt_cache_retention` in seconds (pydantic has already refused other values)."""
    return PROMPT_CACHE_RETENTION_S[value] if value is not None else 0.0


def chat_breakpoint(req: ChatCompletionRequest) -> tuple[int, float] | None:
    """(index of the last message with a `cache_control` content part, the longest TTL asked), or None.
    Every `cache_control` is checked: a 400 naming it for anything but Anthropic's ephemeral form."""
    found: tuple[int, float] | None = None
    for i, message in enumerate(req.messages):
        if not isinstance(message.content, list):
            continue
        for j, part in enumerate(message.content):
            control: Any = part.get("cache_control") if isinstance(part, dict) else None
            if control is None:
                continue
            param = f"messages[{i}].content[{j}].cache_control"
            if (
                not isinstance(control, dict)
                or control.get("type") != "ephemeral"
                or set(control) - {"type", "ttl"}
            ):
                raise bad_request(f'{param} must be {{"type": "ephemeral"}} with an optional ttl.', param)
            ttl = control.get("ttl", "5m")
            # (a list or an object is no key of the map: checked first, since it cannot be hashed; and the
            # value is never repeated back, as server.errors says)
            if not isinstance(ttl, str) or ttl not in CACHE_CONTROL_TTL_S:
                raise bad_request(f'{param}.ttl must be "5m" or "1h".', f"{param}.ttl")
            seconds = CACHE_CONTROL_TTL_S[ttl]
            found = (i, max(seconds, found[1]) if found else seconds)
    return found


async def chat_retention(
    engine: EngineClient, req: ChatCompletionRequest, prompt: list[int], namespace: CacheNamespace | None
) -> tuple[float, int | None]:
    """(TTL seconds, prompt tokens to retain: None for all) of a chat request; (0, None) for none."""
    seconds = retention_seconds(req.prompt_cache_retention)
    marked = chat_breakpoint(req)
    if marked is None or seconds >= marked[1]:
        return seconds, None
    index, ttl = marked
    if index == len(req.messages) - 1:
        return ttl, None
    # The tokens the prompt shares with the conversation rendered up to the marked message (its template's
    # own tokens after it included where they match): what a later request repeating it will hit.
    upto = await off_loop(
        render_chat,
        engine.tokenizer,
        req.messages[: index + 1],
        add_generation_prompt=False,
        continue_final_message=False,
        chat_template_kwargs=req.chat_template_kwargs,
        tools=req.tools if req.tool_choice != "none" else None,
        reuse=True,
        namespace=namespace,
    )
    shared = 0
    for a, b in zip(upto, prompt, strict=False):
        if a != b:
            break
        shared += 1
    return ttl, shared
