"""Structured outputs and forced tool calls, from request fields to an `engine.structured_output` spec.

Accepted, one constraint per request (two at once is a 400):
- OpenAI's `response_format`: `{"type": "json_object"}` and `{"type": "json_schema", "json_schema": {"name",
  "schema", "strict"}}` (`text` is no constraint);
- vLLM's extras `guided_json`, `guided_regex`, `guided_choice`, `guided_grammar` (EBNF), and the newer
  `structured_outputs` object with one of `json`, `regex`, `choice`, `grammar`, `json_object`;
- on chat, `tools` with `tool_choice` `"required"` or a named function: the output is constrained to a call
  of that function (its `parameters` schema), as vLLM does on any model, and reported as `tool_calls`.
  `"auto"` needs the model's own tool-call format (`server.tool_parsers`: Hermes-style `<tool_call>` blocks,
  as Qwen2.5 / Qwen3 templates have); elsewhere, the default model's SmolLM2 template included, it is a 400.

Whether a schema compiles is the grammar engine's to say (in the engine, off its step thread): a
`StructuredOutputError` there becomes a 400 naming the field.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import Request

from engine.structured_spec import StructuredOutputSpec, schema_text
from server.errors import APIError, bad_request
from server.generation import OutputStream, unless_disconnected
from server.protocol import ChatCompletionRequest, CompletionRequest


@dataclass(slots=True)
class ToolCallPlan:
    """A forced tool call. `name`: the named function (the output is its arguments); None for "required"
    (the output is `{"name": ..., "parameters": {...}}` for one of the tools)."""

    name: str | None
    spec: StructuredOutputSpec

    def parse(self, text: str) -> tuple[str, str] | None:
        """(function name, arguments as a JSON string) from a finished output; None if it is not a whole call
        (cut short by max_tokens or a stop string)."""
        try:
            value = json.loads(text)
        except ValueError:
            return None
        if self.name is not None:
            return self.name, json.dumps(value, ensure_ascii=False)
        if not isinstance(value, dict) or not isinstance(value.get("name"), str):
            return None
        return value["name"], json.dumps(value.get("parameters", {}), ensure_ascii=False)


def new_tool_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


def _schema_text(schema: Any, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError:
            raise bad_request(f"{param} is not valid JSON.", param) from None
    if not isinstance(schema, dict):
        raise bad_request(f"{param} must be a JSON schema object.", param)
    return schema_text(schema)


def _response_format(req: ChatCompletionRequest | CompletionRequest) -> StructuredOutputSpec | None:
    fmt = req.response_format
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return StructuredOutputSpec("json_object")
    body = fmt.json_schema
    if not isinstance(body, dict) or "schema" not in body:
        raise bad_request(
            'response_format type "json_schema" needs json_schema.schema (and a name).', "response_format"
        )
    return StructuredOutputSpec("json_schema", _schema_text(body["schema"], "response_format"))


def structured_spec(
    req: ChatCompletionRequest | CompletionRequest,
) -> tuple[str, StructuredOutputSpec] | None:
    """The one output constraint a request asks for (not counting tools) and the field that asked, or None."""
    found: list[tuple[str, StructuredOutputSpec]] = []
    if (spec := _response_format(req)) is not None:
        found.append(("response_format", spec))
    if req.guided_json is not None:
        found.append(
            ("guided_json", StructuredOutputSpec("json_schema", _schema_text(req.guided_json, "guided_json")))
        )
    if req.guided_regex is not None:
        found.append(("guided_regex", StructuredOutputSpec("regex", req.guided_regex)))
    if req.guided_choice is not None:
        found.append(("guided_choice", _choice(req.guided_choice, "guided_choice")))
    if req.guided_grammar is not None:
        found.append(("guided_grammar", StructuredOutputSpec("grammar", req.guided_grammar)))
    so = req.structured_outputs
    if so is not None:
        inner: list[StructuredOutputSpec] = []
        if so.json_ is not None:
            inner.append(StructuredOutputSpec("json_schema", _schema_text(so.json_, "structured_outputs")))
        if so.regex is not None:
            inner.append(StructuredOutputSpec("regex", so.regex))
        if so.choice is not None:
            inner.append(_choice(so.choice, "structured_outputs"))
        if so.grammar is not None:
            inner.append(StructuredOutputSpec("grammar", so.grammar))
        if so.json_object:
            inner.append(StructuredOutputSpec("json_object"))
        if len(inner) != 1:
            raise bad_request(
                "structured_outputs must set exactly one of json, regex, choice, grammar, json_object.",
                "structured_outputs",
            )
        found.append(("structured_outputs", inner[0]))
    if len(found) > 1:
        names = ", ".join(name for name, _ in found)
        raise bad_request(f"Only one output constraint may be given; got {names}.", found[1][0])
    return found[0] if found else None


async def start_constrained(request: Request, stream: OutputStream, param: str | None) -> None:
    """Starts `stream`; a grammar that does not compile is a 400 naming the field that carried it."""
    try:
        await unless_disconnected(request, stream.start(getattr(request.app.state, "inflight", None)))
    except APIError as exc:
        if param is not None and exc.param == "response_format":
            exc.param = param
        raise


def _choice(choices: list[str], param: str) -> StructuredOutputSpec:
    if not choices:
        raise bad_request(f"{param} needs at least one choice.", param)
    return StructuredOutputSpec("choice", json.dumps(choices, ensure_ascii=False))


def _functions(tools: list[Any]) -> dict[str, dict[str, Any]]:
    """name -> parameters schema, for each `{"type": "function", "function": {...}}` tool."""
    out: dict[str, dict[str, Any]] = {}
    for tool in tools:
        fn = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type", "function") != "function"
            or not isinstance(fn, dict)
        ):
            raise bad_request('Each tool must be {"type": "function", "function": {"name": ...}}.', "tools")
        name = fn.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request("Each tool's function needs a name.", "tools")
        params = fn.get("parameters")
        if params is None:  # OpenAI: omitted parameters mean an empty parameter list
            params = {"type": "object", "properties": {}}
        if not isinstance(params, dict):
            raise bad_request(f"The parameters of function {name!r} must be a JSON schema object.", "tools")
        out[name] = params
    return out


def tool_call_plan(req: ChatCompletionRequest, auto_tools: bool = False) -> ToolCallPlan | None:
    """The forced tool call a chat request asks for, or None (no tools, tool_choice "none", or "auto" where
    `auto_tools`: the model's chat template has its own tool-call format, which `server.tool_parsers` reads
    out of the unconstrained output)."""
    if not req.tools or req.tool_choice == "none":
        return None
    choice = req.tool_choice
    if choice is None or choice == "auto":
        if auto_tools:
            _functions(req.tools)  # malformed tools are the same 400 as with a forced call
            return None
        raise bad_request(
            'tool_choice "auto" is not supported: this model\'s chat template has no tool-call format. Send '
            'tool_choice "required" or {"type": "function", "function": {"name": ...}} to force a call, or '
            '"none".',
            "tool_choice",
        )
    functions = _functions(req.tools)
    if choice == "required":
        options = [
            {
                "type": "object",
                "properties": {"name": {"type": "string", "enum": [name]}, "parameters": params},
                "required": ["name", "parameters"],
                "additionalProperties": False,
            }
            for name, params in functions.items()
        ]
        schema = options[0] if len(options) == 1 else {"anyOf": options}
        return ToolCallPlan(None, StructuredOutputSpec("json_schema", _schema_text(schema, "tools")))
    if isinstance(choice, dict):
        fn = choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if choice.get("type", "function") != "function" or not isinstance(name, str):
            raise bad_request(
                'A named tool_choice is {"type": "function", "function": {"name": ...}}.', "tool_choice"
            )
        if name not in functions:
            raise bad_request(f"tool_choice names function {name!r}, which is not in tools.", "tool_choice")
        return ToolCallPlan(name, StructuredOutputSpec("json_schema", _schema_text(functions[name], "tools")))
    raise bad_request('tool_choice must be "none", "auto", "required" or a named function.', "tool_choice")
