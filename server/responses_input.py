"""From a Responses API request to the chat request Brine already serves: input items to chat messages,
function tools and `tool_choice` to chat's shapes, `text.format` to `response_format`.

So `/v1/responses` runs on the chat path (`server.serving_chat.prepare_chat`): the same limits, tenancy,
chat template, forced and Hermes tool calls, and structured outputs. What does not map is a 400 naming the
Responses field (`input`, `tools`, `tool_choice`, `text`, ...), checked here before anything is tokenized.

Input items accepted (OpenAI's `ResponseInputItem` shapes):
- messages, with or without `"type": "message"`: role `user`, `system`, `developer` or `assistant`; content a
  string or a list of `input_text` / `output_text` / `refusal` parts (images and files are a 400);
- `function_call` (`call_id`, `name`, `arguments`): an earlier call, an assistant message's `tool_calls` (calls
  in a row are one message, as chat templates expect);
- `function_call_output` (`call_id`, `output` a string or text parts): a `tool` message.
"""

from __future__ import annotations

from typing import Any

from server.errors import bad_request
from server.protocol import ChatCompletionRequest
from server.responses_protocol import ResponsesRequest

_ROLES = frozenset({"user", "system", "developer", "assistant"})
_TEXT_PARTS = frozenset({"input_text", "output_text", "text"})


def input_items(req: ResponsesRequest) -> list[dict[str, Any]]:
    """The request's `input` as a list of items (a string is one user message)."""
    if isinstance(req.input, str):
        return [{"type": "message", "role": "user", "content": req.input}]
    if not req.input:
        raise bad_request("input must not be an empty list.", "input")
    return list(req.input)


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list):
        raise bad_request(f"{where} must be a string or a list of text parts.", "input")
    texts: list[str] = []
    for part in content:
        kind = part.get("type") if isinstance(part, dict) else None
        kind = kind if isinstance(kind, str) else None  # (a list or an object cannot be looked up in a set)
        key = "text" if kind in _TEXT_PARTS else "refusal" if kind == "refusal" else None
        value = part.get(key) if key is not None and isinstance(part, dict) else None
        if not isinstance(value, str):
            raise bad_request(
                f"{where}: only input_text, output_text and refusal parts are supported.", "input"
            )
        texts.append(value)
    # Templates expect a string; chat joins text parts the same way (server.prompts).
    return "\n".join(texts)


def _string(item: dict[str, Any], key: str, where: str) -> str:
    value = item.get(key)
    if not isinstance(value, str) or not value:
        raise bad_request(f"{where} needs a non-empty string {key}.", "input")
    return value


def chat_messages(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Chat messages (plain dicts, `server.protocol.ChatMessage`'s shape) for a list of items."""
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        where = f"input[{i}]"
        if not isinstance(item, dict):
            raise bad_request(f"{where} must be an object.", "input")
        kind = item.get("type", "message")
        if kind == "message":
            role = item.get("role")
            if not isinstance(role, str) or role not in _ROLES:
                raise bad_request(
                    f"{where}.role must be one of user, system, developer and assistant.", "input"
                )
            messages.append({"role": role, "content": _text(item.get("content"), f"{where}.content")})
        elif kind == "function_call":
            call = {
                "id": _string(item, "call_id", where),
                "type": "function",
                "function": {
                    "name": _string(item, "name", where),
                    "arguments": item.get("arguments") if isinstance(item.get("arguments"), str) else "{}",
                },
            }
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant" and "tool_call_id" not in last:
                last.setdefault("tool_calls", []).append(call)
                last["content"] = last["content"] or None
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            messages.append(
                {
                    "role": "tool",
                    "tool_call_id": _string(item, "call_id", where),
                    "content": _text(item.get("output"), f"{where}.output"),
                }
            )
        else:
            shown = kind if isinstance(kind, str) and len(kind) <= 40 else "this"
            raise bad_request(
                f"{where}: input items of type {shown!r} are not supported (message, function_call and "
                "function_call_output are).",
                "input",
            )
    return messages


def chat_tools(tools: list[dict[str, Any]] | None) -> list[dict[str, Any]] | None:
    """Responses function tools (`{"type": "function", "name", "parameters", ...}`) in chat's nested shape."""
    if not tools:
        return None
    out = []
    for i, tool in enumerate(tools):
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise bad_request(f"tools[{i}]: only function tools are supported.", "tools")
        name = tool.get("name")
        if not isinstance(name, str) or not name:
            raise bad_request(f"tools[{i}] needs a name.", "tools")
        fn: dict[str, Any] = {"name": name}
        for key in ("description", "parameters", "strict"):
            if tool.get(key) is not None:
                fn[key] = tool[key]
        out.append({"type": "function", "function": fn})
    return out


def chat_tool_choice(choice: str | dict[str, Any] | None, tools: list[dict[str, Any]] | None) -> Any:
    """`tool_choice` in chat's shape: the options as they are, `{"type": "function", "name"}` nested."""
    if choice is None or choice in ("none", "auto", "required"):
        return choice
    if isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        if not tools:
            raise bad_request("tool_choice names a function, but tools is empty.", "tool_choice")
        return {"type": "function", "function": {"name": choice["name"]}}
    raise bad_request(
        'tool_choice must be "none", "auto", "required" or {"type": "function", "name": ...}.', "tool_choice"
    )


def response_format(req: ResponsesRequest) -> dict[str, Any] | None:
    fmt = req.text.format if req.text is not None else None
    if fmt is None or fmt.type == "text":
        return None
    if fmt.type == "json_object":
        return {"type": "json_object"}
    if fmt.schema_ is None or not fmt.name:
        raise bad_request('text.format of type "json_schema" needs a name and a schema.', "text")
    return {
        "type": "json_schema",
        "json_schema": {"name": fmt.name, "schema": fmt.schema_, "strict": bool(fmt.strict)},
    }


def check_unsupported(req: ResponsesRequest) -> None:
    if req.background:
        raise bad_request("background responses are not supported.", "background")
    if req.conversation is not None:
        raise bad_request(
            "conversation is not supported; continue with previous_response_id instead.", "conversation"
        )
    if req.prompt is not None:
        raise bad_request("prompt templates are not supported; send input and instructions.", "prompt")
    if req.top_logprobs:
        raise bad_request("top_logprobs is not supported on /v1/responses.", "top_logprobs")


def chat_request(req: ResponsesRequest, messages: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat request that generates `req`'s response; `messages`: the conversation so far, this request's
    input included, without instructions (they are not carried over from a previous response)."""
    if req.instructions:
        messages = [{"role": "system", "content": req.instructions}, *messages]
    tools = chat_tools(req.tools)
    body: dict[str, Any] = {
        "model": req.model,
        "messages": messages,
        "max_completion_tokens": req.max_output_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "stop": req.stop,
        "user": req.user,
        "tools": tools,
        "tool_choice": chat_tool_choice(req.tool_choice, tools),
        "response_format": response_format(req),
        "seed": req.seed,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "prompt_cache_retention": req.prompt_cache_retention,
    }
    if req.cache_salt is not None:
        body["cache_salt"] = req.cache_salt
    # Built from checked values, so validation cannot fail on the client's input here.
    return ChatCompletionRequest.model_validate({k: v for k, v in body.items() if v is not None})
