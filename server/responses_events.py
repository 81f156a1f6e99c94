"""A response's output items and its stream of events, built from the chat deltas of its one sequence.

The chat path (`server.serving_chat.ChatGeneration.deltas`) already turns engine outputs into content deltas
and tool-call deltas (forced calls, Hermes-style calls). `ResponseBuilder` folds those into the Responses
API's output items and the events OpenAI documents for building them, each with its `sequence_number`:

    response.created, response.in_progress,
    for a message:  response.output_item.added, response.content_part.added,
                    response.output_text.delta ..., response.output_text.done,
                    response.content_part.done, response.output_item.done
    for a call:     response.output_item.added, response.function_call_arguments.delta ...,
                    response.function_call_arguments.done, response.output_item.done
    response.completed (or response.incomplete when max_output_tokens cut the output short)

The non-streamed response is the same builder with its events dropped, so both agree item for item.
"""

from __future__ import annotations

import uuid
from copy import deepcopy
from typing import Any


def item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _text_part(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


class ResponseBuilder:
    """Feed it the chat chunks of one sequence (`feed`), then `finish`. `output` holds the items."""

    def __init__(self) -> None:
        self.output: list[dict[str, Any]] = []
        self.sequence_number = 0
        self.finish_reason: str | None = None
        self._message: dict[str, Any] | None = None  # the open message item
        self._text: list[str] = []
        self._call: dict[str, Any] | None = None  # the open function_call item

    def event(self, kind: str, **fields: Any) -> dict[str, Any]:
        out = {"type": kind, **fields, "sequence_number": self.sequence_number}
        self.sequence_number += 1
        return out

    def lifecycle(self, kind: str, response: dict[str, Any]) -> dict[str, Any]:
        """`response.created` / `in_progress` / `completed` / `incomplete` / `failed`, with a snapshot."""
        return self.event(kind, response=deepcopy(response))

    def feed(self, chunk: dict[str, Any]) -> list[dict[str, Any]]:
        """The events for one chat chunk (its first choice: a response has one)."""
        choice = chunk["choices"][0]
        delta = choice.get("delta") or {}
        events: list[dict[str, Any]] = []
        if delta.get("content"):
            events += self._content(delta["content"])
        for call in delta.get("tool_calls") or ():
            events += self._tool_call(call)
        if choice.get("finish_reason") is not None:
            self.finish_reason = choice["finish_reason"]
        return events

    def finish(self) -> list[dict[str, Any]]:
        """Close whatever item is open (incomplete when the output was cut short)."""
        status = "incomplete" if self.finish_reason == "length" else "completed"
        return self._close_message(status) + self._close_call(status)

    # ---- items -------------------------------------------------------------------------------------------

    def _content(self, text: str) -> list[dict[str, Any]]:
        events = self._close_call("completed")
        if self._message is None:
            self._message = {
                "id": item_id("msg"),
                "type": "message",
                "role": "assistant",
                "status": "in_progress",
                "content": [],
            }
            self._text = []
            self.output.append(self._message)
            index = len(self.output) - 1
            events.append(
                self.event("response.output_item.added", output_index=index, item=deepcopy(self._message))
            )
            events.append(
                self.event(
                    "response.content_part.added",
                    item_id=self._message["id"],
                    output_index=index,
                    content_index=0,
                    part=_text_part(""),
                )
            )
        self._text.append(text)
        events.append(
            self.event(
                "response.output_text.delta",
                item_id=self._message["id"],
                output_index=len(self.output) - 1,
                content_index=0,
                delta=text,
                logprobs=[],
            )
        )
        return events

    def _close_message(self, status: str) -> list[dict[str, Any]]:
        message = self._message
        if message is None:
            return []
        self._message = None
        index = self.output.index(message)
        text = "".join(self._text)
        message["content"] = [_text_part(text)]
        message["status"] = status
        where = {"item_id": message["id"], "output_index": index, "content_index": 0}
        return [
            self.event("response.output_text.done", **where, text=text, logprobs=[]),
            self.event("response.content_part.done", **where, part=_text_part(text)),
            self.event("response.output_item.done", output_index=index, item=deepcopy(message)),
        ]

    def _tool_call(self, call: dict[str, Any]) -> list[dict[str, Any]]:
        fn = call.get("function") or {}
        events: list[dict[str, Any]] = []
        if call.get("id") is not None:  # a new call: its id and name come first
            events += self._close_message("completed") + self._close_call("completed")
            self._call = {
                "id": item_id("fc"),
                "type": "function_call",
                "status": "in_progress",
                "call_id": call["id"],
                "name": fn.get("name", ""),
                "arguments": "",
            }
            self.output.append(self._call)
            index = len(self.output) - 1
            events.append(
                self.event("response.output_item.added", output_index=index, item=deepcopy(self._call))
            )
        arguments = fn.get("arguments") or ""
        if arguments and self._call is not None:
            self._call["arguments"] += arguments
            events.append(
                self.event(
                    "response.function_call_arguments.delta",
                    item_id=self._call["id"],
                    output_index=self.output.index(self._call),
                    delta=arguments,
                )
            )
        return events

    def _close_call(self, status: str) -> list[dict[str, Any]]:
        call = self._call
        if call is None:
            return []
        self._call = None
        index = self.output.index(call)
        call["status"] = status
        return [
            self.event(
                "response.function_call_arguments.done",
                item_id=call["id"],
                output_index=index,
                name=call["name"],
                arguments=call["arguments"],
            ),
            self.event("response.output_item.done", output_index=index, item=deepcopy(call)),
        ]
