"""Tool calls a model writes in its own format, for `tool_choice: "auto"`: which chat templates have one, and
the parser that turns the model's text into `content` and `tool_calls`, whole or as stream deltas.

The format is Hermes-style, as in the chat templates of Qwen2.5 / Qwen3 (and NousResearch's Hermes), the one
vLLM's `hermes` tool parser reads: each call is a block `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`
in the output. A template supports it when it mentions `<tool_call>` and renders the `tools` it is given,
and the tokenizer keeps `<tool_call>` in decoded text (probed once per tokenizer); SmolLM2's template, the
default model's, does neither.

How text is split (one parser per choice; the whole text and the same text token by token give the same
result, because the non-streamed response is the streamed parser fed everything at once):
- text outside the blocks is `content`, less the whitespace next to a block; `content` is null when the
  output is only calls;
- a block becomes a call once its head `{"name": "...", "arguments": ` has been read: the stream then sends the
  call's id and name, then the raw text of the `arguments` object in pieces as it is made. What the model put
  inside `arguments` is not checked (OpenAI's own advice: validate arguments before calling the function);
- a block without that head (other key order, `arguments` not an object) is read whole at `</tool_call>`: a
  JSON object with a string `name` is a call (arguments re-serialised); anything else (malformed JSON, no name)
  stays `content`, tags included. vLLM instead turns the whole output into content when any block is
  malformed; here the good blocks still count, as a stream that already sent them must;
- an output that ends inside a block (max_tokens, a stop string) keeps a call already announced, with the
  arguments made so far (cut by max_tokens, finish_reason stays "length", as for a forced call cut short);
  an unannounced block is read whole as above, as vLLM reads an unterminated last block.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from functools import lru_cache
from typing import Any

from server.engine_client import TokenizerLike
from server.structured import new_tool_call_id

TOOL_CALL_START = "<tool_call>"
TOOL_CALL_END = "</tool_call>"

# The head of a block whose arguments can be streamed: a name (a JSON string literal), then the arguments key.
_HEAD = re.compile(r'\s*\{\s*"name"\s*:\s*("(?:[^"\\]|\\.)*")\s*,\s*"arguments"\s*:\s*')
_MAX_HEAD = 1024
_PROBE_NAME = "brine_probe_tool_7f3a"
_PROBE_TOOL = {
    "type": "function",
    "function": {
        "name": _PROBE_NAME,
        "description": "probe",
        "parameters": {"type": "object", "properties": {}},
    },
}


def supports_hermes_tools(tokenizer: TokenizerLike) -> bool:
    """Whether the tokenizer's chat template has Hermes-style tool calls: it mentions `<tool_call>` and puts
    the tools it is given into the prompt, and `<tool_call>` is not a special token dropped from the output."""
    return _probe(tokenizer)


@lru_cache(maxsize=8)  # one answer per tokenizer (by identity): the template does not change while serving
def _probe(tokenizer: TokenizerLike) -> bool:
    template = getattr(tokenizer, "chat_template", None)
    if not template or TOOL_CALL_START not in str(template):
        return False
    try:
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": "hi"}], add_generation_prompt=True, tools=[_PROBE_TOOL]
        )
    except Exception:  # a template that cannot render tools does not support them
        return False
    if not isinstance(text, str) or _PROBE_NAME not in text:
        return False
    # Output text is decoded without special tokens: where `<tool_call>` is one, the blocks would vanish and
    # calls would be lost silently; a 400 says so instead.
    try:
        return TOOL_CALL_START in tokenizer.decode(tokenizer.encode(TOOL_CALL_START))
    except Exception:
        return False


@dataclass(slots=True)
class ParsedToolCall:
    id: str
    name: str
    arguments: str  # a JSON string (raw as the model wrote it when streamed)

    def as_dict(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "type": "function",
            "function": {"name": self.name, "arguments": self.arguments},
        }


def _partial_tag(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper beginning of `tag` (held back: it may be the tag)."""
    for n in range(min(len(text), len(tag) - 1), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


@dataclass(slots=True)
class HermesToolParser:
    """Feed it an output's text as it comes (`feed`), then `finish`; each returns the chat deltas to send
    (`{"content": ...}` or `{"tool_calls": [...]}`). Afterwards `content` and `calls` hold the whole result."""

    calls: list[ParsedToolCall] = field(default_factory=list)
    _content: list[str] = field(default_factory=list)
    _pending: str = ""  # text not yet placed: a possible partial tag
    _in_block: bool = False
    _block: str = ""  # the current block's text so far
    _ws: str = ""  # trailing whitespace outside blocks, dropped if a block follows
    _ws_before_block: str = ""  # ... kept here while the block may still turn out to be content
    _after_block: bool = False  # whitespace right after a call is dropped too
    _call: ParsedToolCall | None = None  # the open block's call, once its head was read
    _scan: int = 0  # how far into `_block` its arguments were scanned (and sent)
    _depth: int = 0
    _in_string: bool = False
    _escape: bool = False
    _args_done: bool = False
    _whole_only: bool = False  # the open block has no streamable head: read it whole at its end

    @property
    def content(self) -> str | None:
        text = "".join(self._content)
        return None if self.calls and not text else text

    def step(self, text: str, finish_reason: str | None) -> tuple[list[dict[str, Any]], str | None]:
        """The deltas for the next piece of an output and, when it is the last (`finish_reason` set), the
        finish reason to report: "tool_calls" instead of "stop" once a call was made."""
        deltas = self.feed(text)
        if finish_reason is None:
            return deltas, None
        return deltas + self.finish(), self.finish_reason(finish_reason)

    def finish_reason(self, reason: str) -> str:
        # A call cut short keeps "length", as a forced call does: the client can tell it is incomplete.
        return "tool_calls" if self.calls and reason == "stop" else reason

    def feed(self, text: str) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        self._pending += text
        while self._pending:
            if not self._in_block:
                start = self._pending.find(TOOL_CALL_START)
                if start < 0:
                    keep = _partial_tag(self._pending, TOOL_CALL_START)
                    self._outside(self._pending[: len(self._pending) - keep], out)
                    self._pending = self._pending[len(self._pending) - keep :]
                    break
                self._outside(self._pending[:start], out)
                self._pending = self._pending[start + len(TOOL_CALL_START) :]
                self._open_block()
                continue
            end = self._pending.find(TOOL_CALL_END)
            if end < 0:
                keep = _partial_tag(self._pending, TOOL_CALL_END)
                self._block += self._pending[: len(self._pending) - keep]
                self._pending = self._pending[len(self._pending) - keep :]
                self._advance(out)
                break
            self._block += self._pending[:end]
            self._pending = self._pending[end + len(TOOL_CALL_END) :]
            self._advance(out)
            self._close(out, TOOL_CALL_END)
        return out

    def finish(self) -> list[dict[str, Any]]:
        """The output ended: place what was held back."""
        out: list[dict[str, Any]] = []
        if self._in_block:  # ended inside a block: no end tag
            self._block += self._pending
            self._pending = ""
            self._advance(out)
            self._close(out, "")
        elif self._pending:
            self._send(out, self._ws + self._pending)
            self._ws = self._pending = ""
        if self._ws and not self.calls:  # a plain answer keeps its trailing whitespace
            self._send(out, self._ws)
        self._ws = ""
        return out

    def _send(self, out: list[dict[str, Any]], text: str) -> None:
        if text:
            self._content.append(text)
            out.append({"content": text})

    def _outside(self, text: str, out: list[dict[str, Any]]) -> None:
        if self._after_block:
            text = text.lstrip()
            self._after_block = not text
        body = text.rstrip()
        if body:
            self._send(out, self._ws + body)
            self._ws = ""
        self._ws += text[len(body) :]

    def _open_block(self) -> None:
        self._in_block, self._block = True, ""
        self._ws_before_block, self._ws = self._ws, ""
        self._call, self._scan, self._depth = None, 0, 0
        self._in_string = self._escape = self._args_done = self._whole_only = False

    def _advance(self, out: list[dict[str, Any]]) -> None:
        """Announce the open block's call once its head is read, then send its arguments as they come."""
        if self._call is None:
            if self._whole_only:
                return
            head = _HEAD.match(self._block)
            if head is None or head.end() == len(self._block):
                # No head yet. Past a length no real head reaches, stop looking: matching again at every
                # token would cost the square of a long block.
                self._whole_only = head is None and len(self._block) > _MAX_HEAD
                return
            try:
                name = json.loads(head.group(1))
            except ValueError:
                name = None
            if self._block[head.end()] != "{" or not isinstance(name, str) or not name:
                self._whole_only = True
                return
            self._call = ParsedToolCall(new_tool_call_id(), name, "")
            self._scan = head.end()
            self._ws_before_block, self._after_block = "", False
            call_head = {"index": len(self.calls), "id": self._call.id, "type": "function"}
            out.append({"tool_calls": [{**call_head, "function": {"name": name, "arguments": ""}}]})
            self.calls.append(self._call)
        if self._args_done:
            return
        begin = self._scan
        for i in range(self._scan, len(self._block)):
            ch = self._block[i]
            if self._in_string:
                if self._escape:
                    self._escape = False
                elif ch == "\\":
                    self._escape = True
                elif ch == '"':
                    self._in_string = False
            elif ch == '"':
                self._in_string = True
            elif ch in "{[":
                self._depth += 1
            elif ch in "}]":
                self._depth -= 1
                if self._depth == 0:
                    self._args_done = True
                    self._scan = i + 1
                    break
        else:
            self._scan = len(self._block)
        piece = self._block[begin : self._scan]
        if piece:
            self._call.arguments += piece
            out.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]})

    def _close(self, out: list[dict[str, Any]], end_tag: str) -> None:
        """The open block ended (`end_tag` is what closed it, "" at the end of the output)."""
        self._in_block = False
        if self._call is not None:
            self._call, self._after_block = None, True
            return
        call = _whole_call(self._block)
        if call is None:  # not a call: its text, tags and all, is content
            self._send(out, self._ws_before_block + TOOL_CALL_START + self._block + end_tag)
            self._ws_before_block, self._after_block = "", False
            return
        self._ws_before_block, self._after_block = "", True
        head = {"index": len(self.calls), "id": call.id, "type": "function"}
        out.append({"tool_calls": [{**head, "function": {"name": call.name, "arguments": call.arguments}}]})
        self.calls.append(call)


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """(content, tool_calls) of a whole output."""
    parser = HermesToolParser()
    parser.feed(text)
    parser.finish()
    return parser.content, [call.as_dict() for call in parser.calls]


def _whole_call(block: str) -> ParsedToolCall | None:
    try:
        value = json.loads(block)
    except ValueError:
        return None
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    args = value.get("arguments", value.get("parameters", {}))
    arguments = args if isinstance(args, str) else json.dumps(args, ensure_ascii=False)
    return ParsedToolCall(new_tool_call_id(), value["name"], arguments)
