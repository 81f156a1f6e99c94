"""The body of `POST /v1/responses` (OpenAI's Responses API), as a pydantic model.

Fields follow OpenAI's `ResponseCreateParams` where Brine can honour them, plus `cache_salt` (as on chat) and
vLLM's sampling extras. What Brine cannot honour is refused with a 400 naming the field rather than silently
ignored (`background`, `conversation`, `prompt`, `top_logprobs`, tools that are not functions); fields that change
nothing a client can observe here (`reasoning`, `include`, `service_tier`, `truncation`, ...) are ignored as
on chat. Input items are checked one by one in `server.responses_input`, which names the item in its 400.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field, field_validator
from pydantic_core import PydanticCustomError

from server.protocol import _INT64_MAX, _INT64_MIN, CACHE_SALT_CODE, CacheSalt, PromptCacheKey, _Request

MAX_METADATA_KEYS = 16  # OpenAI's limits on `metadata`
MAX_METADATA_KEY_CHARS = 64
MAX_METADATA_VALUE_CHARS = 512


class TextFormat(_Request):
    """`text.format`: plain text, any JSON object, or JSON matching a schema (structured outputs)."""

    type: Literal["text", "json_object", "json_schema"]
    name: str | None = None
    description: str | None = None
    # `schema` would shadow BaseModel.schema: the field is schema_, sent as "schema".
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None  # accepted, as a hint nothing here reads


class ResponsesRequest(_Request):
    model: str | None = None  # optional, as in vLLM: the one served model is the default
    # A string (one user message) or a list of input items (messages, function calls and their outputs).
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    stop: str | list[str] | None = None  # a vLLM extra; OpenAI's Responses API has none
    metadata: dict[str, str] | None = None
    user: str | None = None
    store: bool | None = True
    stream: bool | None = False
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = True
    text: TextConfig | None = None
    previous_response_id: str | None = Field(default=None, min_length=1, max_length=256)
    prompt_cache_key: PromptCacheKey = None  # echoed on the response object, as OpenAI does
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    cache_salt: CacheSalt = None
    # Refused when set (Brine has no background jobs, no server-side conversations, no logprobs here).
    background: bool | None = False
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None  # a prompt template stored at OpenAI
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    # vLLM extras
    seed: int | None = Field(default=None, ge=_INT64_MIN, le=_INT64_MAX)
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)

    @field_validator("cache_salt", mode="before")
    @classmethod
    def _salt_not_null(cls, value: Any) -> Any:
        if value is None:
            raise PydanticCustomError(CACHE_SALT_CODE, "cache_salt must be a string; omit it for no salt")
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_limits(cls, value: dict[str, str] | None) -> dict[str, str] | None:
        if value is None:
            return None
        if len(value) > MAX_METADATA_KEYS:
            raise PydanticCustomError(
                "metadata_too_large", f"at most {MAX_METADATA_KEYS} key-value pairs are allowed"
            )
        for key, item in value.items():
            if len(key) > MAX_METADATA_KEY_CHARS or len(item) > MAX_METADATA_VALUE_CHARS:
                raise PydanticCustomError(
                    "metadata_too_long",
                    f"keys may be at most {MAX_METADATA_KEY_CHARS} characters and values at most "
                    f"{MAX_METADATA_VALUE_CHARS}",
                )
        return value


# ---- what the routes return, for /openapi.json (the routes build plain dicts: server.serving_responses) ------


class InputTokensDetails(BaseModel):
    cached_tokens: int = Field(description="Prompt tokens served from the prefix cache.")
    cache_write_tokens: int = Field(
        description="Prompt tokens this request computed and left cached for the next one: those of its full "
        "blocks that were not already cached (only full blocks are cached)."
    )


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = Field(description="Always 0: Brine's models do not reason apart from the output.")


class ResponseUsage(BaseModel):
    input_tokens: int = Field(description="All prompt tokens, cached ones included (OpenAI's definition).")
    input_tokens_details: InputTokensDetails
    output_tokens: int
    output_tokens_details: OutputTokensDetails
    total_tokens: int


class ResponseObject(BaseModel):
    """A response (`object: "response"`); with `stream: true`, the same object arrives in `response.created`,
    `response.in_progress` and `response.completed` (or `response.incomplete` / `response.failed`) events."""

    id: str
    object: Literal["response"]
    created_at: int
    completed_at: int | None = None
    status: Literal["completed", "incomplete", "in_progress", "failed"]
    model: str
    output: list[dict[str, Any]] = Field(description="Output items: `message` and `function_call`.")
    usage: ResponseUsage | None
    incomplete_details: dict[str, Any] | None
    error: dict[str, Any] | None
    instructions: str | None
    previous_response_id: str | None
    prompt_cache_key: str | None = Field(description="Echoed from the request: a routing hint only.")
    store: bool
    metadata: dict[str, str]


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"]
    deleted: bool
