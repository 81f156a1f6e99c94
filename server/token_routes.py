"""`POST /tokenize` and `POST /detokenize`: vLLM's token routes, a prompt or chat turned into token ids and
back, checked as generation checks its text (`server.text_check`) and never on the event loop."""

from __future__ import annotations

import anyio
from fastapi import FastAPI

from server.engine_client import EngineClient, TokenizerLike
from server.errors import bad_request
from server.openapi import BODY_ERRORS
from server.params import check_chat_template, check_model
from server.prompts import encode, off_loop, render_chat
from server.protocol import DetokenizeRequest, TokenizeRequest
from server.text_check import check_text

DETOKENIZE_THREADS = 2


def _decode(tokenizer: TokenizerLike, tokens: list[int]) -> str:
    """`/detokenize`'s work, in a worker thread: the vocabulary check is a pass over every id too."""
    vocab = tokenizer.vocab_size
    if any(t < 0 or (vocab is not None and t >= vocab) for t in tokens):
        raise bad_request("tokens contains a token id outside the vocabulary.", "tokens")
    return tokenizer.decode(tokens)


def install_token_routes(app: FastAPI, engine: EngineClient) -> None:
    @app.post("/tokenize", operation_id="tokenize", responses=BODY_ERRORS)
    async def tokenize(req: TokenizeRequest) -> dict:
        check_text(req)
        check_model(req.model, engine.model_name)
        check_chat_template(req.chat_template)
        if (req.prompt is None) == (req.messages is None):
            raise bad_request("Send exactly one of prompt and messages.", "prompt")
        if req.messages is not None:
            if not req.messages:
                raise bad_request("messages must not be empty.", "messages")
            tokens = await off_loop(
                render_chat,
                engine.tokenizer,
                req.messages,
                add_generation_prompt=req.add_generation_prompt,
                continue_final_message=req.continue_final_message,
                chat_template_kwargs=req.chat_template_kwargs,
            )
        else:
            tokens = await off_loop(
                encode,
                engine.tokenizer,
                req.prompt or "",
                add_special_tokens=req.add_special_tokens,
                param="prompt",
            )
        return {"count": len(tokens), "max_model_len": engine.max_model_len, "tokens": tokens}

    # Decoding a long list costs milliseconds per thousand ids: never on the event loop (every stream's
    # tokens go out from it), and at most two at once, so a flood of big bodies queues here instead of
    # taking every worker thread that tokenizing needs.
    detokenizing = anyio.CapacityLimiter(DETOKENIZE_THREADS)

    @app.post("/detokenize", operation_id="detokenize", responses=BODY_ERRORS)
    async def detokenize(req: DetokenizeRequest) -> dict:
        check_text(req)
        check_model(req.model, engine.model_name)
        limit = app.state.limits.max_detokenize_tokens
        if len(req.tokens) > limit:
            raise bad_request(
                f"Invalid 'tokens': at most {limit} token ids per request, got {len(req.tokens)}.",
                "tokens",
                "array_above_max_length",
            )
        text = await anyio.to_thread.run_sync(_decode, engine.tokenizer, req.tokens, limiter=detokenizing)
        return {"prompt": text}
