"""The cache fields of a Messages response, told truly: how many prompt tokens came from the prefix cache, how
many this request computed and left cached for the next one, and the rest.

- `cache_read_input_tokens`: what the engine reports, `RequestOutput.num_cached_tokens`.
- `cache_creation_input_tokens`: the prompt tokens up to the last `cache_control` breakpoint, or, with none,
  those of the prompt's full KV blocks (`block_size` each), less the ones read; 0 without prefix caching.
  The engine caches every full block of a prompt as it is computed (by hash), and a later prompt reuses the
  leading tokens of a cached block, or of the partial block a finished request leaves, token by token
  (`kv_cache.manager`: the tail): so the tokens up to a breakpoint are all there for the next request, even
  when the breakpoint falls inside a block. Without a breakpoint only the full blocks are promised.
- `input_tokens`: the rest (Anthropic's definition: the three add up to the prompt). OpenAI's `prompt_tokens`
  counts cached tokens too.

Where a breakpoint falls in tokens: the request is rendered once more with a marker right after the marked
block's text (`server.messages_convert.to_chat`), and the breakpoint is the number of leading tokens the text
before the marker shares with the real prompt, so a template's own tokens around a message count where they
are, and a token the marker split is not counted.
"""

from __future__ import annotations

import logging
import uuid
from dataclasses import dataclass

from kv_cache.namespace import CacheNamespace
from server.engine_client import TokenizerLike
from server.messages_convert import to_chat
from server.messages_protocol import MessagesRequest
from server.prompts import encode, template_messages

logger = logging.getLogger("brine.server")


@dataclass(slots=True)
class CacheUsage:
    input_tokens: int
    cache_creation_input_tokens: int
    cache_read_input_tokens: int


def cache_usage(
    num_prompt_tokens: int, num_read: int, breakpoint_tokens: int | None, *, block_size: int, caching: bool
) -> CacheUsage:
    """`breakpoint_tokens`: the prompt tokens up to the last breakpoint, None when there is none."""
    read = min(max(num_read, 0), num_prompt_tokens)
    if not caching:
        kept = 0
    elif breakpoint_tokens is not None:
        kept = min(breakpoint_tokens, num_prompt_tokens)
    else:
        kept = num_prompt_tokens // block_size * block_size
    created = max(kept - read, 0)
    return CacheUsage(num_prompt_tokens - read - created, created, read)


def breakpoint_tokens(
    tokenizer: TokenizerLike,
    req: MessagesRequest,
    item: int,
    prompt: list[int],
    *,
    auto_tools: bool,
    namespace: CacheNamespace | None,
) -> int | None:
    """How many leading tokens of `prompt` lie before the end of block `item` (see the module docstring);
    None when the template does not render that block (then the full-block rule applies)."""
    marker = f"<<brine-breakpoint-{uuid.uuid4().hex}>>"
    marked = to_chat(req, auto_tools=auto_tools, marker=(item, marker))
    if not marked.marker_placed:  # the breakpoint is on the last block and it has no text: all of it
        return len(prompt)
    chat = marked.chat
    kwargs = {"tools": chat.tools} if chat.tools and chat.tool_choice != "none" else {}
    try:
        text = tokenizer.apply_chat_template(
            template_messages(chat.messages),
            add_generation_prompt=bool(chat.add_generation_prompt),
            continue_final_message=bool(chat.continue_final_message),
            **kwargs,
        )
    except Exception as exc:  # the real render just succeeded: this is a template reacting to the marker
        logger.info("chat template refused the breakpoint render: %s", type(exc).__name__)
        return None
    at = text.find(marker) if isinstance(text, str) else -1
    if at < 0 or text.find(marker, at + 1) >= 0:
        return None
    ids = encode(
        tokenizer, text[:at], add_special_tokens=False, param="messages", reuse=True, namespace=namespace
    )
    shared = 0
    for a, b in zip(ids, prompt, strict=False):
        if a != b:
            break
        shared += 1
    return shared
