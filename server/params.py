"""From a validated request to what the engine needs: the model check, rules spanning several fields,
the context-length check, and the `SamplingParams`.

Everything here raises `APIError` (400/404), or `ContextLengthError` (mapped to its 400 by
`server.errors`), so that no user input reaches the engine's own `validate()`
unchecked; that `ValueError` is still mapped to a 400 as a last line of defence.
"""

from __future__ import annotations

from engine.errors import ContextLengthError
from engine.sampling_params import SamplingParams
from engine.structured_output import StructuredOutputSpec
from server.errors import APIError, bad_request
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.retention import retention_seconds


def check_model(requested: str | None, served: str) -> None:
    if requested is None or requested == served:
        return
    shown = requested if len(requested) <= 100 else requested[:100] + "..."
    raise APIError(f"The model `{shown}` does not exist.", status=404, param="model", code="model_not_found")


def check_chat_template(chat_template: str | None) -> None:
    # The template comes from the model (see server.prompts.render_chat for why a request's own is refused).
    if chat_template is not None:
        raise bad_request(
            "chat_template is not supported: the chat template always comes from the model.", "chat_template"
        )


def check_chat_features(req: ChatCompletionRequest) -> None:
    """Reject what Brine cannot honour instead of silently ignoring it (the client would get wrong output)."""
    check_chat_template(req.chat_template)
    if req.functions and req.function_call != "none":
        raise bad_request("Function calling is not supported.", "functions")
    if req.top_logprobs and not req.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", "top_logprobs")
    if req.add_generation_prompt and req.continue_final_message:
        raise bad_request(
            "add_generation_prompt and continue_final_message cannot both be true.", "continue_final_message"
        )
    if req.continue_final_message and req.messages[-1].role != "assistant":
        raise bad_request("continue_final_message needs an assistant message last.", "continue_final_message")


def check_completion_features(req: CompletionRequest) -> None:
    if req.suffix:
        raise bad_request("suffix is not supported.", "suffix")


def _check_shared(req: ChatCompletionRequest | CompletionRequest, vocab_size: int | None) -> None:
    if req.logit_bias:
        raise bad_request("logit_bias is not supported.", "logit_bias")
    for token_id in req.stop_token_ids or ():
        if token_id < 0 or (vocab_size is not None and token_id >= vocab_size):
            raise bad_request("stop_token_ids contains a token id outside the vocabulary.", "stop_token_ids")


def resolve_max_tokens(
    requested: int | None, param: str, num_prompt_tokens: int, max_model_len: int, prompt_param: str
) -> int:
    """The number of tokens to generate; raises `ContextLengthError` when prompt + output cannot fit."""
    if requested is not None and requested < 1:
        raise bad_request(f"{param} must be at least 1.", param)
    if num_prompt_tokens == 0:
        raise bad_request("The prompt must contain at least one token.", prompt_param)
    if requested is None:
        if num_prompt_tokens >= max_model_len:
            raise ContextLengthError(
                max_model_len,
                f"your request has {num_prompt_tokens} input tokens, which leaves no room for output.",
                prompt_param,
            )
        return max_model_len - num_prompt_tokens
    if num_prompt_tokens + requested > max_model_len:
        raise ContextLengthError(
            max_model_len,
            f"you requested {num_prompt_tokens + requested} tokens ({num_prompt_tokens} in the input, "
            f"{requested} in the completion). Please reduce the length of the input or of {param}.",
            prompt_param,
        )
    return requested


def sampling_params(
    req: ChatCompletionRequest | CompletionRequest,
    *,
    num_prompt_tokens: int,
    max_model_len: int,
    vocab_size: int | None,
    structured: StructuredOutputSpec | None = None,
) -> SamplingParams:
    _check_shared(req, vocab_size)
    if isinstance(req, ChatCompletionRequest):
        param = "max_completion_tokens" if req.max_completion_tokens is not None else "max_tokens"
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        prompt_param = "messages"
        logprobs = (req.top_logprobs or 0) if req.logprobs else None
        prompt_logprobs = None
    else:
        param, requested, prompt_param = "max_tokens", req.max_tokens, "prompt"
        logprobs = req.logprobs
        prompt_logprobs = req.logprobs if req.echo else None
    max_tokens = resolve_max_tokens(requested, param, num_prompt_tokens, max_model_len, prompt_param)

    temperature = 1.0 if req.temperature is None else req.temperature
    top_p = 1.0 if req.top_p is None else req.top_p
    if top_p == 0:
        # A nucleus of zero mass keeps only the most likely token: that is greedy decoding.
        temperature, top_p = 0.0, 1.0
    min_tokens = req.min_tokens or 0
    if min_tokens > max_tokens:
        raise bad_request("min_tokens must not exceed the maximum number of tokens.", "min_tokens")
    stop = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    params = SamplingParams(
        n=req.n or 1,
        max_tokens=max_tokens,
        temperature=temperature,
        top_p=top_p,
        top_k=req.top_k or 0,
        min_p=req.min_p or 0.0,
        seed=req.seed,
        presence_penalty=req.presence_penalty or 0.0,
        frequency_penalty=req.frequency_penalty or 0.0,
        repetition_penalty=1.0 if req.repetition_penalty is None else req.repetition_penalty,
        stop=[s for s in stop if s],  # an empty stop string would match everywhere
        stop_token_ids=list(req.stop_token_ids or []),
        ignore_eos=bool(req.ignore_eos),
        min_tokens=min_tokens,
        logprobs=logprobs,
        prompt_logprobs=prompt_logprobs,
        include_stop_str_in_output=bool(req.include_stop_str_in_output),
        structured=structured,
        retention_s=retention_seconds(req.prompt_cache_retention),
    )
    try:
        params.validate()
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    return params
