"""Request bodies of Anthropic's Messages API (`POST /v1/messages`, `POST /v1/messages/count_tokens`), and the
response shapes `/openapi.json` documents for them, as pydantic v2 models.

What is accepted: `system` as a string or text blocks; `messages` whose content is a string or text,
`tool_use` and `tool_result` blocks; `tools` (custom tools with an `input_schema`) and `tool_choice` (`auto`,
`any`, `tool` by name, `none`); `cache_control` (`{"type": "ephemeral"}`, optional `ttl` "5m" | "1h") on
system, message and tool blocks, at most 4 per request as Anthropic allows, and top-level (a breakpoint on the
last block); Brine's `cache_salt` as an extra.
A block type Brine cannot honour (images, documents, thinking, server tools) is a 400 naming the field,
never silently dropped. Unknown top-level fields are ignored and logged, as on the OpenAI routes.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError

from server.protocol import CACHE_SALT_CODE, CacheSalt, _Request

MAX_CACHE_BREAKPOINTS = 4  # Anthropic's limit on cache_control blocks per request


class CacheControl(_Request):
    type: Literal["ephemeral"]
    # Every full KV block is cached whatever the TTL; the TTL is how long the blocks up to the last breakpoint
    # are retained after their last hit (server.messages_convert's Breakpoint; docs/messages.md).
    ttl: Literal["5m", "1h"] | None = None


class TextBlock(_Request):
    type: Literal["text"]
    text: str
    cache_control: CacheControl | None = None


class ToolUseBlock(_Request):
    type: Literal["tool_use"]
    id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    input: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolResultBlock(_Request):
    type: Literal["tool_result"]
    tool_use_id: str = Field(min_length=1)
    content: str | list[TextBlock] | None = None
    is_error: bool | None = None
    cache_control: CacheControl | None = None


ContentBlock = Annotated[TextBlock | ToolUseBlock | ToolResultBlock, Field(discriminator="type")]


class MessageParam(_Request):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class Tool(_Request):
    # Custom (client) tools only: Anthropic's server tools (web search, bash, ...) run on Anthropic's side.
    type: Literal["custom"] | None = None
    name: str = Field(min_length=1, max_length=128)
    description: str | None = None
    input_schema: dict[str, Any]
    cache_control: CacheControl | None = None


class ToolChoice(_Request):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None  # required for type "tool"
    disable_parallel_tool_use: bool | None = None  # accepted: Brine makes at most one forced call anyway


class Metadata(_Request):
    user_id: str | None = None


class Thinking(_Request):
    # Extended thinking needs a model trained for it: only "disabled" is accepted (server.messages_convert).
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class _MessagesFields(_Request):
    """What both Messages routes read: the conversation and its tools."""

    model: str | None = None  # optional, as on chat: the one served model is the default
    messages: list[MessageParam] = Field(min_length=1)
    system: str | list[TextBlock] | None = None
    tools: list[Tool] | None = None
    tool_choice: ToolChoice | None = None
    thinking: Thinking | None = None
    # Anthropic's automatic caching: a breakpoint on the request's last block.
    cache_control: CacheControl | None = None
    cache_salt: CacheSalt = None

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _salt_not_null(cls, value: Any) -> Any:
        if value is None:
            raise PydanticCustomError(CACHE_SALT_CODE, "cache_salt must be a string; omit it for no salt")
        return value


class MessagesRequest(_MessagesFields):
    max_tokens: int = Field(ge=1)  # required, as Anthropic requires it
    stop_sequences: list[str] | None = None
    temperature: float | None = Field(default=None, ge=0, le=1)
    top_p: float | None = Field(default=None, ge=0, le=1)
    top_k: int | None = Field(default=None, ge=0)
    stream: bool | None = False
    metadata: Metadata | None = None


class CountTokensRequest(_MessagesFields):
    pass


# ---- responses (documentation only: the routes build plain dicts, server.serving_messages) ---------------


class Usage(BaseModel):
    input_tokens: int = Field(
        description="Prompt tokens neither read from the cache nor counted in cache_creation_input_tokens "
        "(Anthropic's definition: cached tokens are excluded). input_tokens + cache_creation_input_tokens + "
        "cache_read_input_tokens is the whole prompt."
    )
    output_tokens: int
    cache_creation_input_tokens: int = Field(
        description="Prompt tokens this request computed and left in the prefix cache for the next one: "
        "those up to its last cache_control breakpoint, or those of its full KV blocks when it has none, "
        "less the ones read from the cache. 0 when the server runs without prefix caching."
    )
    cache_read_input_tokens: int = Field(description="Prompt tokens served from the prefix cache.")


class ResponseBlock(BaseModel):
    type: Literal["text", "tool_use"]
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None


class MessageResponse(BaseModel):
    id: str
    type: Literal["message"]
    role: Literal["assistant"]
    model: str
    content: list[ResponseBlock]
    stop_reason: Literal["end_turn", "max_tokens", "stop_sequence", "tool_use"]
    stop_sequence: str | None
    usage: Usage


class TokenCount(BaseModel):
    input_tokens: int


class AnthropicErrorInfo(BaseModel):
    type: str
    message: str


class AnthropicError(BaseModel):
    type: Literal["error"]
    error: AnthropicErrorInfo


def _documented(model: type[BaseModel], description: str) -> dict[str, Any]:
    return {"model": model, "description": description}


_ERRORS: dict[int | str, dict[str, Any]] = {
    400: _documented(
        AnthropicError, "Invalid request (`invalid_request_error`): the message names the field."
    ),
    401: _documented(AnthropicError, "Missing or wrong API key (`x-api-key` or `Authorization: Bearer`)."),
    404: _documented(AnthropicError, "The requested model is not served here (`not_found_error`)."),
    413: _documented(AnthropicError, "The request body is larger than the server accepts."),
}
MESSAGES_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {
        "model": MessageResponse,
        "description": "The message, or with `stream: true` Anthropic's server-sent events (`message_start`, "
        "`content_block_start` / `_delta` / `_stop`, `message_delta` with `stop_reason` and usage, "
        "`message_stop`). Usage carries `cache_read_input_tokens` and `cache_creation_input_tokens`.",
        "content": {"text/event-stream": {}},
    },
    **_ERRORS,
    503: _documented(AnthropicError, "The engine is not running (`api_error`)."),
}
COUNT_TOKENS_RESPONSES: dict[int | str, dict[str, Any]] = {
    200: {"model": TokenCount, "description": "The prompt's tokens: system, messages and tools, rendered."},
    **_ERRORS,
}
