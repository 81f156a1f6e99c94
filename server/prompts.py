"""Turning request input into prompt token ids: chat messages through the model's chat template, and the
four shapes of a completions `prompt`.

Template errors (a template that rejects a role order, say) are the client's to fix: they become 400s, and
so does text the tokenizer cannot take; each is one log line, never a traceback.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

from jinja2 import TemplateError
from starlette.concurrency import run_in_threadpool

from engine.errors import ContextLengthError
from kv_cache.namespace import CacheNamespace
from server.engine_client import TokenizerLike
from server.errors import bad_request
from server.protocol import ChatMessage

P = ParamSpec("P")
T = TypeVar("T")
logger = logging.getLogger("brine.server")
_KWARGS = "chat_template_kwargs"


def _message_text(message: ChatMessage, index: int) -> str:
    content = message.content
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts: list[str] = []
    for part in content:
        kind = part.get("type")
        text = part.get("text") if kind == "text" else part.get("refusal") if kind == "refusal" else None
        if not isinstance(text, str):
            raise bad_request(f"messages.{index}.content: only text content parts are supported.", "messages")
        texts.append(text)
    # Templates expect a string; joining parts with newlines is what vLLM does for string-format templates.
    return "\n".join(texts)


async def off_loop(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """Runs a tokenizing function in a worker thread: tokenizing (or rendering) a long prompt takes long, and
    the event loop must keep serving streams. Every route that tokenizes goes through here."""
    return await run_in_threadpool(fn, *args, **kwargs)


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Messages as plain dicts for the Jinja template (only the keys a template may read)."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        item: dict[str, Any] = {"role": message.role, "content": _message_text(message, i)}
        if message.name is not None:
            item["name"] = message.name
        if message.tool_calls:
            item["tool_calls"] = [_template_tool_call(call) for call in message.tool_calls]
        if message.tool_call_id is not None:
            item["tool_call_id"] = message.tool_call_id
        out.append(item)
    return out


def _template_tool_call(call: dict[str, Any]) -> dict[str, Any]:
    """An earlier tool call as templates read it: OpenAI sends `arguments` as a JSON string, and templates
    (Qwen's `tool_call.arguments | tojson`) expect the object, so it is decoded where it parses (as vLLM does)."""
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("arguments"), str):
        return call
    try:
        arguments = json.loads(fn["arguments"])
    except ValueError:
        return call
    return {**call, "function": {**fn, "arguments": arguments}}


def encode(
    tokenizer: TokenizerLike,
    text: str,
    *,
    add_special_tokens: bool,
    param: str = "prompt",
    reuse: bool = False,
    namespace: CacheNamespace | None = None,
    limit: int | None = None,
) -> list[int]:
    """Token ids of `text`; text the tokenizer refuses is the client's to fix: a 400 naming `param`.
    `reuse`: a generation request's prompt, whose pieces the tokenizer may reuse from and keep for earlier
    prompts of the same cache `namespace` (engine.piece_cache). `limit`: the context length; a text the
    tokenizer finds longer is a `ContextLengthError` naming `param`, raised before all of it is tokenized
    (a 4 MB prompt must not hold a worker thread for a second to learn that it does not fit)."""
    try:
        ids = tokenizer.encode(
            text, add_special_tokens=add_special_tokens, reuse=reuse, namespace=namespace, limit=limit
        )
        return list(ids)
    except ContextLengthError as exc:
        exc.param = param
        raise
    except Exception as exc:
        logger.info("the tokenizer refused the text of %s: %s", param, type(exc).__name__)
        raise bad_request(f"{param} contains text that cannot be tokenized.", param, "invalid_text") from None


def render_chat(
    tokenizer: TokenizerLike,
    messages: list[ChatMessage],
    *,
    add_generation_prompt: bool,
    continue_final_message: bool,
    chat_template_kwargs: dict[str, Any] | None,
    tools: list[Any] | None = None,
    reuse: bool = False,
    namespace: CacheNamespace | None = None,
    limit: int | None = None,
) -> list[int]:
    """The prompt of a chat: `messages` (and `tools`, for templates that render them) through the model's
    template, then tokenized (`reuse`, `namespace`, `limit`: as `encode`'s)."""
    kwargs = dict(chat_template_kwargs or {})
    if "chat_template" in kwargs:
        # The template comes from the model. A request's own template would be an arbitrary Jinja program: even
        # in the worker thread it holds the GIL, so one nested loop stalls every request and grows memory
        # without bound.
        raise bad_request("chat_template_kwargs must not replace the model's chat template.", _KWARGS)
    # These two are ours to set; letting chat_template_kwargs repeat them would raise a TypeError.
    kwargs.pop("add_generation_prompt", None)
    kwargs.pop("continue_final_message", None)
    kwargs.pop("messages", None)
    if tools:
        kwargs["tools"] = tools  # the request's own field wins over a copy in chat_template_kwargs
    plain = template_messages(messages)
    try:
        text = tokenizer.apply_chat_template(
            plain,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=continue_final_message,
            **kwargs,
        )
    except Exception as exc:  # jinja may raise anything; all of it is the request's fault
        logger.info("chat template rejected a request: %s", type(exc).__name__)
        # Only the template's own words are repeated (raise_exception("Conversation roles must alternate"),
        # an undefined name): any other exception's text may quote the request's messages back.
        cause = exc if isinstance(exc, TemplateError) else exc.__cause__
        reason = f": {cause.message}" if isinstance(cause, TemplateError) and cause.message else ""
        raise bad_request(f"The chat template could not render these messages{reason}.", "messages") from None
    if not isinstance(text, str):
        raise bad_request("The chat template did not produce text.", "messages")
    # The rendered template already contains the special tokens it wants (BOS included, if any).
    return encode(
        tokenizer,
        text,
        add_special_tokens=False,
        param="messages",
        reuse=reuse,
        namespace=namespace,
        limit=limit,
    )


def completion_prompts(
    tokenizer: TokenizerLike,
    prompt: str | list[str] | list[int] | list[list[int]] | None,
    vocab: int | None,
    namespace: CacheNamespace | None = None,
    limit: int | None = None,
) -> list[list[int]]:
    """One list of token ids per prompt; text prompts are encoded with the tokenizer's special tokens, reusing
    the pieces of earlier prompts of the request's cache `namespace`, and refused once past `limit` tokens
    (see `encode`)."""
    if prompt is None:
        raise bad_request("prompt is required.", "prompt")
    if isinstance(prompt, str):
        raw: list[str | list[int]] = [prompt]
    elif not prompt:
        raise bad_request("prompt must not be an empty list.", "prompt")
    elif isinstance(prompt[0], int):
        raw = [prompt]
    else:
        raw = list(prompt)
    out: list[list[int]] = []
    for item in raw:
        if isinstance(item, str):
            out.append(
                encode(
                    tokenizer,
                    item,
                    add_special_tokens=True,
                    param="prompt",
                    reuse=True,
                    namespace=namespace,
                    limit=limit,
                )
            )
            continue
        if not item:
            raise bad_request("A token-id prompt must not be empty.", "prompt")
        if any(t < 0 or (vocab is not None and t >= vocab) for t in item):
            raise bad_request("prompt contains a token id outside the vocabulary.", "prompt")
        out.append(list(item))
    return out
