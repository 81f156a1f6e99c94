"""An Anthropic Messages request as the chat request it means (`ChatCompletionRequest`), so that it takes the
chat path whole: the same checks, tenancy, limits, chat template, forced tool calls and sampling.

The mapping:
- `system` (a string or text blocks) is the first, system, message; text blocks become text parts;
- an assistant message's `tool_use` blocks become its `tool_calls` (`input` as the JSON `arguments`); a user
  message's `tool_result` blocks become `tool` messages (`tool_call_id`), in order, around its text;
- an assistant message last is continued (Anthropic's prefill), as chat's `continue_final_message`;
- `tools` become function tools (`input_schema` as `parameters`); `tool_choice` `auto` / `any` / `tool` /
  `none` become `"auto"` / `"required"` / a named function / `"none"`; with tools and no `tool_choice`,
  Anthropic's default is `auto`;
- `stop_sequences` -> `stop`, `metadata.user_id` -> `user`; `cache_salt` as it is.

Also where the request's last `cache_control` breakpoint is (`Breakpoint`): its place in the order Anthropic
caches in (tools, then system, then messages), which `server.messages_cache` turns into a token count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from server.errors import bad_request, validation_error
from server.limits import RequestLimits
from server.messages_protocol import (
    MAX_CACHE_BREAKPOINTS,
    CountTokensRequest,
    MessagesRequest,
    TextBlock,
    ToolResultBlock,
    ToolUseBlock,
)
from server.protocol import ChatCompletionRequest


@dataclass(slots=True)
class Breakpoint:
    """The last `cache_control` breakpoint: `item` counts the request's blocks in cache order (tools, system
    blocks, message blocks; a string is one block), `ttl` is what it asked for (accepted, not yet honoured)."""

    item: int
    ttl: str


@dataclass(slots=True)
class Converted:
    chat: ChatCompletionRequest
    breakpoint: Breakpoint | None
    marker_placed: bool = True  # False: the marker was to go before a next block's text, and none came


def check_messages_limits(req: MessagesRequest, limits: RequestLimits) -> None:
    """Chat's limits on stop strings, named as this API names them."""
    stops = req.stop_sequences or []
    if len(stops) > limits.max_stop_strings:
        raise bad_request(
            f"Invalid 'stop_sequences': expected an array with at most {limits.max_stop_strings} entries, got "
            f"{len(stops)}.",
            "stop_sequences",
            "array_above_max_length",
        )
    if any(len(s) > limits.max_stop_string_chars for s in stops):
        raise bad_request(
            f"Invalid 'stop_sequences': each stop sequence may be at most {limits.max_stop_string_chars} "
            "characters long.",
            "stop_sequences",
            "string_above_max_length",
        )


def to_chat(
    req: MessagesRequest | CountTokensRequest, *, auto_tools: bool, marker: tuple[int, str] | None = None
) -> Converted:
    """The chat request `req` means. `auto_tools`: whether the model's template has its own tool-call format
    (else `tool_choice` `auto` is a 400, as on chat). `marker`: (item, text) puts `text` right after that
    block's text, or before the next block's text when it has none (a tool, a tool_use): how
    `server.messages_cache` finds where a breakpoint falls in the rendered prompt."""
    if req.thinking is not None and req.thinking.type != "disabled":
        raise bad_request("Extended thinking is not supported by this model.", "thinking")
    walk = _Walk(marker)
    tools = [walk.tool(t.name, t.description, t.input_schema, t.cache_control) for t in req.tools or ()]
    messages: list[dict[str, Any]] = []
    if isinstance(req.system, str):
        messages.append({"role": "system", "content": walk.text(req.system, None)})
    elif req.system:
        messages.append({"role": "system", "content": [walk.part(b) for b in req.system]})
    for i, message in enumerate(req.messages):
        messages.extend(walk.message(message.role, message.content, i))
    if req.cache_control is not None:  # top-level: on the last block, whatever it is
        walk.count += 1
        walk.breakpoint = Breakpoint(walk.item, req.cache_control.ttl or "5m")
    if walk.count > MAX_CACHE_BREAKPOINTS:
        raise bad_request(
            f"A request may have at most {MAX_CACHE_BREAKPOINTS} blocks with cache_control, got {walk.count}.",
            "messages",
        )
    last_assistant = req.messages[-1].role == "assistant"
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "add_generation_prompt": not last_assistant,
        "continue_final_message": last_assistant,
    }
    if tools:
        body["tools"] = tools
        body["tool_choice"] = _tool_choice(req, auto_tools, {t["function"]["name"] for t in tools})
    if req.cache_salt is not None:
        body["cache_salt"] = req.cache_salt
    if isinstance(req, MessagesRequest):
        body.update(max_tokens=req.max_tokens, temperature=req.temperature, top_p=req.top_p, top_k=req.top_k)
        body.update(stop=req.stop_sequences, stream=bool(req.stream))
        if req.metadata is not None and req.metadata.user_id is not None:
            body["user"] = req.metadata.user_id
    try:
        chat = ChatCompletionRequest.model_validate(body)
    except ValidationError as exc:  # what our own checks let through is valid chat: kept a 400 regardless
        raise validation_error(exc) from None
    return Converted(chat, walk.breakpoint, not walk.carrying)


def _tool_choice(req: MessagesRequest | CountTokensRequest, auto_tools: bool, names: set[str]) -> Any:
    choice = req.tool_choice
    kind = choice.type if choice is not None else "auto"
    if kind == "none":
        return "none"
    if kind == "any":
        return "required"
    if kind == "tool":
        assert choice is not None
        if not choice.name:
            raise bad_request('tool_choice of type "tool" needs the tool\'s name.', "tool_choice")
        if choice.name not in names:
            raise bad_request(
                f"tool_choice names tool {choice.name!r}, which is not in tools.", "tool_choice"
            )
        return {"type": "function", "function": {"name": choice.name}}
    if not auto_tools and isinstance(req, MessagesRequest):
        raise bad_request(
            'tool_choice "auto" (the default with tools) is not supported: this model\'s chat template has '
            'no tool-call format. Send tool_choice {"type": "any"} or {"type": "tool", "name": ...} to force '
            'a call, or {"type": "none"}.',
            "tool_choice",
        )
    return "auto"


class _Walk:
    """Visits the request's blocks in cache order, counting breakpoints and placing the marker."""

    def __init__(self, marker: tuple[int, str] | None) -> None:
        self.item = -1
        self.count = 0
        self.breakpoint: Breakpoint | None = None
        self._marker = marker
        self._carry = ""  # a marker waiting for the next block with text

    @property
    def carrying(self) -> bool:
        return bool(self._carry)

    def _visit(self, cache_control: Any, has_text: bool) -> str:
        """Counts one block; returns the marker text to put before (carried) or after (own) its text."""
        self.item += 1
        if cache_control is not None:
            self.count += 1
            self.breakpoint = Breakpoint(self.item, cache_control.ttl or "5m")
        if self._marker is not None and self._marker[0] == self.item:
            if has_text:
                return self._marker[1]
            self._carry = self._marker[1]
        return ""

    def text(self, text: str, cache_control: Any) -> str:
        after = self._visit(cache_control, True)
        before, self._carry = self._carry, ""
        return before + text + after

    def part(self, block: TextBlock) -> dict[str, Any]:
        return {"type": "text", "text": self.text(block.text, block.cache_control)}

    def tool(self, name: str, description: str | None, schema: dict[str, Any], cc: Any) -> dict[str, Any]:
        self._visit(cc, False)
        fn: dict[str, Any] = {"name": name, "parameters": schema}
        if description is not None:
            fn["description"] = description
        return {"type": "function", "function": fn}

    def message(self, role: str, content: Any, index: int) -> list[dict[str, Any]]:
        if isinstance(content, str):
            return [{"role": role, "content": self.text(content, None)}]
        out: list[dict[str, Any]] = []
        parts: list[dict[str, Any]] = []
        calls: list[dict[str, Any]] = []
        for block in content:
            if isinstance(block, TextBlock):
                parts.append(self.part(block))
            elif isinstance(block, ToolUseBlock):
                if role != "assistant":
                    raise bad_request(
                        f"messages.{index}: tool_use blocks belong to assistant messages.", "messages"
                    )
                self._visit(block.cache_control, False)
                arguments = json.dumps(block.input, ensure_ascii=False)
                calls.append(
                    {
                        "id": block.id,
                        "type": "function",
                        "function": {"name": block.name, "arguments": arguments},
                    }
                )
            elif isinstance(block, ToolResultBlock):
                if role != "user":
                    raise bad_request(
                        f"messages.{index}: tool_result blocks belong to user messages.", "messages"
                    )
                if parts:  # text before a result stays before it
                    out.append({"role": "user", "content": parts})
                    parts = []
                result = block.content
                inner = result if isinstance(result, list) else []
                text = result if isinstance(result, str) else "\n".join(b.text for b in inner)
                # A breakpoint on a text block inside the result marks the result.
                cc = block.cache_control or next((b.cache_control for b in inner if b.cache_control), None)
                content = self.text(text, cc)
                out.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        if parts or calls or not out:
            message: dict[str, Any] = {"role": role, "content": parts}
            if calls:
                message["tool_calls"] = calls
            out.append(message)
        return out
