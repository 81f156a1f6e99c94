"""`--public-prefix FILE`: prompt prefixes the operator publishes to every tenant, read and turned into token ids.

A file ending in `.json` holds a JSON list of chat messages (the product's system prompt, say), for
`/v1/chat/completions`: it is rendered with the model's chat template, without a generation prompt. Any other
file is plain text, a prompt prefix for `/v1/completions`, tokenized as a completions prompt is. The token ids
go to the engine (`kv_cache.namespace.PublicPrefixes`), which matches them against every request's tokens,
whatever its route.

A prefix only helps if a real prompt starts with exactly its tokens. At startup each prefix is checked, and a
mismatch is logged as a warning rather than sharing nothing silently:
- it is rendered twice and compared (a template that inserts something variable, like today's date);
- a chat prefix is rendered again with a user message after it; a text prefix is tokenized again with more
  text after it: the longer prompt must start with the prefix's tokens (a template that inserts something
  before the system message once more messages follow, or a last token that merges with what follows).
Read the files before loading the model (`read_public_prefix`: bad files stop the server at once), render
them once the tokenizer is there (`render_public_prefix`).
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path

from pydantic import ValidationError

from server.engine_client import TokenizerLike
from server.errors import APIError
from server.prompts import encode, render_chat
from server.protocol import ChatMessage

logger = logging.getLogger("brine.serve")
_PROBE_MESSAGE = ChatMessage(role="user", content="Brine checks how this template continues a conversation.")
_PROBE_TEXT = " Brine checks how this prefix continues."


class PublicPrefixError(ValueError):
    """A --public-prefix file cannot be used; the message names the file."""


@dataclass(slots=True)
class PublicPrefixFile:
    path: str
    messages: list[ChatMessage] | None = None  # a .json file
    text: str | None = None  # any other file

    @property
    def kind(self) -> str:
        return "chat messages" if self.messages is not None else "text"


def read_public_prefix(path: str) -> PublicPrefixFile:
    try:
        raw = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise PublicPrefixError(f"cannot read the public prefix {path}: {exc}") from None
    if not path.endswith(".json"):
        if not raw:
            raise PublicPrefixError(f"the public prefix {path} is empty")
        return PublicPrefixFile(path, text=raw)
    try:
        data = json.loads(raw)
    except ValueError as exc:
        raise PublicPrefixError(f"the public prefix {path} is not valid JSON: {exc}") from None
    if not isinstance(data, list) or not data:
        raise PublicPrefixError(f"the public prefix {path} must be a non-empty JSON list of chat messages")
    try:
        messages = [ChatMessage.model_validate(m) for m in data]
    except ValidationError as exc:
        raise PublicPrefixError(f"the public prefix {path} holds an invalid chat message: {exc}") from None
    return PublicPrefixFile(path, messages=messages)


def _render(tokenizer: TokenizerLike, messages: list[ChatMessage], add_generation_prompt: bool) -> list[int]:
    return render_chat(
        tokenizer,
        messages,
        add_generation_prompt=add_generation_prompt,
        continue_final_message=False,
        chat_template_kwargs=None,
    )


def _common(a: list[int], b: list[int]) -> int:
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def render_public_prefix(tokenizer: TokenizerLike, prefix: PublicPrefixFile) -> list[int]:
    """The prefix's token ids; logs a warning when real prompts would not start with them (see the module
    docstring). PublicPrefixError when the template cannot render the messages at all."""
    try:
        if prefix.messages is not None:
            tokens = _render(tokenizer, prefix.messages, False)
            again = _render(tokenizer, prefix.messages, False)
            longer = _render(tokenizer, [*prefix.messages, _PROBE_MESSAGE], True)
        else:
            assert prefix.text is not None
            tokens = encode(tokenizer, prefix.text, add_special_tokens=True)
            again = encode(tokenizer, prefix.text, add_special_tokens=True)
            longer = encode(tokenizer, prefix.text + _PROBE_TEXT, add_special_tokens=True)
    except APIError as exc:
        raise PublicPrefixError(
            f"the public prefix {prefix.path} cannot be rendered: {exc.message}"
        ) from None
    if not tokens:
        raise PublicPrefixError(f"the public prefix {prefix.path} renders to no tokens")
    if again != tokens:
        logger.warning(
            "public prefix %s renders differently each time (the template inserts something variable, a date "
            "perhaps): requests will rarely start with its tokens, so it will rarely be shared",
            prefix.path,
        )
    elif longer[: len(tokens)] != tokens:
        agree = _common(tokens, longer)
        what = (
            "a conversation that begins with these messages is rendered differently (the chat template "
            "changes or inserts something before them once more messages follow)"
            if prefix.messages is not None
            else "its last tokens merge with text that follows it (end it with a newline or a space)"
        )
        logger.warning(
            "public prefix %s: %s; only its first %d of %d tokens match a longer prompt, so requests will "
            "not share it",
            prefix.path,
            what,
            agree,
            len(tokens),
        )
    return tokens
