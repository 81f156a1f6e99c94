"""The content blocks of one Messages response, built as the output comes: Anthropic's stream events
(`content_block_start` / `content_block_delta` / `content_block_stop`) and, at the end, the same blocks whole.

One `Blocks` per response. A text block grows by `text_delta`s; a `tool_use` block is announced with its id
and name and an empty `input`, then grows by `input_json_delta`s of the JSON text of its input, which the
whole response carries parsed (an object; `{}` where the output was cut short before the JSON ended, as
`stop_reason: "max_tokens"` then says).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any


def new_tool_use_id() -> str:
    return f"toolu_{uuid.uuid4().hex[:24]}"


def tool_input(arguments: str) -> dict[str, Any]:
    """A tool call's input object from its JSON text; {} when it is not a whole JSON object."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


@dataclass(slots=True)
class _Block:
    kind: str  # "text" | "tool_use"
    text: list[str] = field(default_factory=list)  # the text, or the input's JSON text
    id: str = ""
    name: str = ""

    def whole(self) -> dict[str, Any]:
        if self.kind == "text":
            return {"type": "text", "text": "".join(self.text)}
        return {"type": "tool_use", "id": self.id, "name": self.name, "input": tool_input("".join(self.text))}


class Blocks:
    """The response's blocks in order; each method returns the stream events it makes."""

    def __init__(self) -> None:
        self.blocks: list[_Block] = []
        self._open = False

    @property
    def has_tool_use(self) -> bool:
        return any(b.kind == "tool_use" for b in self.blocks)

    def _start(self, block: _Block, start: dict[str, Any]) -> list[dict[str, Any]]:
        events = self.close()
        self.blocks.append(block)
        self._open = True
        index = len(self.blocks) - 1
        return [*events, {"type": "content_block_start", "index": index, "content_block": start}]

    def _delta(self, delta: dict[str, Any]) -> dict[str, Any]:
        return {"type": "content_block_delta", "index": len(self.blocks) - 1, "delta": delta}

    def text(self, text: str, *, open_empty: bool = False) -> list[dict[str, Any]]:
        """`text` added to the open text block (a new one if none is open); `open_empty`: open it even for
        no text (a plain answer starts with its text block, as Anthropic's stream does)."""
        events: list[dict[str, Any]] = []
        if not (self._open and self.blocks[-1].kind == "text"):
            if not text and not open_empty:
                return events
            events = self._start(_Block("text"), {"type": "text", "text": ""})
        if text:
            self.blocks[-1].text.append(text)
            events.append(self._delta({"type": "text_delta", "text": text}))
        return events

    def tool_use(self, name: str, call_id: str | None = None) -> list[dict[str, Any]]:
        block = _Block("tool_use", id=call_id or new_tool_use_id(), name=name)
        return self._start(block, {"type": "tool_use", "id": block.id, "name": name, "input": {}})

    def input_json(self, piece: str) -> list[dict[str, Any]]:
        """More of the open tool_use block's input JSON."""
        if not piece or not self._open or self.blocks[-1].kind != "tool_use":
            return []
        self.blocks[-1].text.append(piece)
        return [self._delta({"type": "input_json_delta", "partial_json": piece})]

    def close(self) -> list[dict[str, Any]]:
        if not self._open:
            return []
        self._open = False
        return [{"type": "content_block_stop", "index": len(self.blocks) - 1}]

    def chat_delta(self, delta: dict[str, Any]) -> list[dict[str, Any]]:
        """A chat delta of `server.tool_parsers.HermesToolParser` (content, or a tool call's head or
        arguments) as block events."""
        if "content" in delta:
            return self.text(delta["content"] or "")
        events: list[dict[str, Any]] = []
        for call in delta.get("tool_calls") or ():
            fn = call.get("function") or {}
            if "id" in call:
                events += self.tool_use(fn.get("name", ""), call["id"])
            events += self.input_json(fn.get("arguments") or "")
        return events

    def whole(self) -> list[dict[str, Any]]:
        return [b.whole() for b in self.blocks]
