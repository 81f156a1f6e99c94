"""Request bodies of the OpenAI-compatible routes, as pydantic v2 models.

Fields follow OpenAI's spec plus the extras vLLM users send (top_k, min_p, ...). Unknown fields are ignored,
as vLLM does, so clients written for other servers keep working. Ranges that the spec fixes are enforced here;
rules that span several fields live in `server.params`. `cache_salt` is deliberately absent: it is checked
(and removed) before these models see the body, so no pydantic message can ever include its value.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


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
        return {
            key: value
            for key, value in data.items()
            if value is not None or key not in cls.model_fields or cls.model_fields[key].default is None
        }


class StreamOptions(_Request):
    include_usage: bool | None = False


class ResponseFormat(_Request):
    type: str


class ChatMessage(_Request):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    # A string, a list of content parts (validated in server.chat_template), or null (assistant tool calls).
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[dict[str, Any]] | None = None
    tool_call_id: str | None = None


class _SamplingFields(_Request):
    """Fields both generation routes share."""

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
    logit_bias: dict[str, float] | None = None
    # vLLM extras
    top_k: int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    ignore_eos: bool | None = False
    min_tokens: int | None = Field(default=0, ge=0)
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool | None = False


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    # vLLM extras
    add_generation_prompt: bool | None = True
    continue_final_message: bool | None = False
    chat_template_kwargs: dict[str, Any] | None = None


class CompletionRequest(_SamplingFields):
    # str | list[str] | list[int] | list[list[int]]; an explicit null counts as absent (a 400: required).
    prompt: str | list[str] | list[int] | list[list[int]] | None
    max_tokens: int | None = 16
    echo: bool | None = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    suffix: str | None = None
    best_of: int | None = None  # accepted and ignored: v1-style engines dropped best_of


class TokenizeRequest(_Request):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None


class DetokenizeRequest(_Request):
    model: str | None = None
    tokens: list[int]


ParsedRequest = ChatCompletionRequest | CompletionRequest | TokenizeRequest | DetokenizeRequest
