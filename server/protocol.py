"""Request bodies of the OpenAI-compatible routes, as pydantic v2 models.

Routes declare these as their bodies, so FastAPI validates them and publishes them in `/openapi.json`. Fields
follow OpenAI's spec plus the extras vLLM users send (top_k, min_p, ...). Unknown fields are ignored, as vLLM
does, so clients written for other servers keep working; each unknown field name is logged once at warning
level, then at debug level. Ranges that the spec fixes are enforced here; rules that span several fields live
in `server.params`. Error messages are built from pydantic's location and message, never its input
(`server.errors.validation_error`), so no value, `cache_salt` included, is ever echoed.
"""

from __future__ import annotations

import logging
import threading
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, WithJsonSchema, field_validator, model_validator
from pydantic_core import PydanticCustomError

from engine.sampling_params import REPETITION_PENALTY_RANGE

logger = logging.getLogger("brine.server")
_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1
MAX_CACHE_SALT_CHARS = 1024
CACHE_SALT_CODE = "invalid_cache_salt"
_CACHE_SALT_DOC = (
    "Isolates this request's prefix-cache entries: KV blocks computed under one salt are never reused by a "
    "request with another salt or with none, so tenants sharing the server cannot learn from "
    "time-to-first-token whether another tenant sent the same prompt. Give each tenant its own salt. Omit "
    "it for no salt; an explicit null is refused, so that a salt lost upstream never silently shares the "
    f"unsalted cache. 1 to {MAX_CACHE_SALT_CHARS} characters; never logged, never echoed in errors."
)
# Absent means "no salt"; null is refused (see the description), so the published schema is a plain string.
CacheSalt = Annotated[
    str | None,
    Field(min_length=1, max_length=MAX_CACHE_SALT_CHARS, strict=True),
    WithJsonSchema(
        {
            "type": "string",
            "minLength": 1,
            "maxLength": MAX_CACHE_SALT_CHARS,
            "title": "Cache Salt",
            "description": _CACHE_SALT_DOC,
        }
    ),
]


class _UnknownFieldLog:
    """Which unknown field names were already logged at warning level. Bounded: a client inventing a new
    name per request must not grow memory; past the bound every name is logged at debug level."""

    MAX_NAMES = 1024

    def __init__(self) -> None:
        self._seen: set[tuple[str, str]] = set()
        # Validation runs on the event loop, but models may be built in any thread (tests, worker threads).
        self._lock = threading.Lock()

    def log(self, model: str, names: set[str]) -> None:
        for name in sorted(names):
            shown = name if len(name) <= 64 else name[:64] + "..."
            with self._lock:
                first = (model, name) not in self._seen and len(self._seen) < self.MAX_NAMES
                if first:
                    self._seen.add((model, name))
            level = logging.WARNING if first else logging.DEBUG
            logger.log(level, "ignoring unknown field %r in %s", shown, model)


UNKNOWN_FIELDS = _UnknownFieldLog()


class _Request(BaseModel):
    # NaN / Infinity are valid in Python's json module but meaningless as sampling settings.
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """OpenAI clients send null for optional fields they leave unset: null must then mean the field's
        default (`max_tokens` 16 on completions, `add_generation_prompt` true), not None, which reads as
        "no limit" or "false" further on."""
        if not isinstance(data, dict):
            return data
        known = set(cls.model_fields) | {f.alias for f in cls.model_fields.values() if f.alias}
        unknown = {key for key in data if isinstance(key, str) and key not in known}
        if unknown:
            UNKNOWN_FIELDS.log(cls.__name__, unknown)
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in cls.model_fields or cls.model_fields[key].default is None
        }


class StreamOptions(_Request):
    include_usage: bool | None = False


class ResponseFormat(_Request):
    type: Literal["text", "json_object", "json_schema"]
    # {"name", "description", "schema", "strict"}: parsed in server.structured (pydantic models cannot have a
    # field named `schema`).
    json_schema: dict[str, Any] | None = None


class StructuredOutputs(_Request):
    """vLLM's `structured_outputs` extra: exactly one of these."""

    # `json` would shadow BaseModel.json: the field is json_, sent as "json".
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # A string, a list of content parts (validated in server.prompts), or null (assistant tool calls).
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


_CHAT_TEMPLATE_DOC = (
    "Not supported: the chat template always comes from the model, and a request that sets this field "
    "(or chat_template_kwargs.chat_template) is refused with a 400."
)


_PROMPT_CACHE_KEY_DOC = (
    "A routing hint, never an isolation key: accepted (1 to 1024 characters), but the prefix cache stays "
    "partitioned by tenant and cache_salt only. A router in front of several replicas can pin requests with one "
    "key to one replica (docs/replicas.md)."
)
# OpenAI's routing hint on chat, completions and responses (see its description).
PromptCacheKey = Annotated[
    str | None, Field(min_length=1, max_length=1024, description=_PROMPT_CACHE_KEY_DOC)
]


class _SamplingFields(_Request):
    """Fields both generation routes share."""

    @field_validator("cache_salt", mode="before", check_fields=False)
    @classmethod
    def _salt_not_null(cls, value: Any) -> Any:
        if value is None:
            raise PydanticCustomError(CACHE_SALT_CODE, "cache_salt must be a string; omit it for no salt")
        return value

    model: str | None = None  # optional, as in vLLM: the one served model is the default
    n: int | None = Field(default=1, ge=1, le=128)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, ge=0, le=1)
    seed: int | None = Field(default=None, ge=_INT64_MIN, le=_INT64_MAX)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    stop: str | list[str] | None = None
    stream: bool | None = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    prompt_cache_key: PromptCacheKey = None
    # "24h": the KV pool keeps the prompt's blocks for 24 hours after their last hit (server.retention).
    prompt_cache_retention: Literal["in_memory", "24h"] | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(
        default=None, ge=REPETITION_PENALTY_RANGE[0], le=REPETITION_PENALTY_RANGE[1]
    )
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False
    # Structured outputs (server.structured): OpenAI's response_format, and vLLM's extras.
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputs | None = None


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    functions: list[Any] | None = None
    function_call: str | dict[str, Any] | None = None
    # vLLM extras
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = Field(default=None, description=_CHAT_TEMPLATE_DOC)
    cache_salt: CacheSalt = None


class CompletionRequest(_SamplingFields):
    # str | list[str] | list[int] | list[list[int]]; an explicit null counts as absent (a 400: required).
    prompt: str | list[str] | list[int] | list[list[int]] | None
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = None  # accepted and ignored: v1-style engines dropped best_of
    cache_salt: CacheSalt = None


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = Field(default=None, description=_CHAT_TEMPLATE_DOC)


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


ParsedRequest = ChatCompletionRequest | CompletionRequest | TokenizeRequest | DetokenizeRequest
