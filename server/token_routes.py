"""`POST /tokenize` and `POST /detokenize`: vLLM's token routes, a prompt or chat turned into token ids and
back, checked as generation checks its text (`server.text_check`) and never on the event loop (`/detokenize`'s
whole work, body to answer, is server.detokenize_pool's)."""

from __future__ import annotations

from typing import Any

import anyio
from fastapi import FastAPI, Request, Response

from engine.tokenizer import Tokenizer
from server.detokenize_pool import DetokenizePool, Job, answer
from server.engine_client import EngineClient
from server.errors import bad_request
from server.openapi import BODY_ERRORS
from server.params import check_chat_template, check_model
from server.prompts import encode, off_loop, render_chat
from server.protocol import DetokenizeRequest, TokenizeRequest
from server.text_check import check_text

DETOKENIZE_THREADS = 2
# A body up to this size (~1,000 ids) is answered in a worker thread of this process: well under a millisecond
# of GIL, where a worker process's round trip would cost about as much again (the normal path stays as fast).
IN_PROCESS_BYTES = 8192


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

    # Reading, checking and decoding a long list costs milliseconds per thousand ids: never on the event
    # loop (every stream's tokens go out from it), nor under the server's GIL where the tokenizer can be sent
    # to a worker process (server.detokenize_pool); at most two at once, so a flood of big bodies queues here
    # instead of taking every worker thread that tokenizing needs.
    detokenizing = anyio.CapacityLimiter(DETOKENIZE_THREADS)
    tokenizer = engine.tokenizer
    pool = None
    if isinstance(tokenizer, Tokenizer):
        pool = DetokenizePool(tokenizer.backend.to_str(), tokenizer.vocab_size, workers=DETOKENIZE_THREADS)
        app.router.on_shutdown.append(pool.close)
    app.state.detokenize_pool = pool

    # The body is read here, not by FastAPI (which would parse it on the event loop): published as it was.
    body_doc = {"content": {"application/json": {"schema": DetokenizeRequest.model_json_schema()}}}

    @app.post(
        "/detokenize",
        operation_id="detokenize",
        responses=BODY_ERRORS,
        response_model=dict[str, Any],
        openapi_extra={"requestBody": {**body_doc, "required": True}},
    )
    async def detokenize(request: Request) -> Response:
        job = Job(
            await request.body(),
            request.headers.get("content-type"),
            engine.model_name,
            app.state.limits.max_detokenize_tokens,
        )
        if pool is not None and len(job.body) > IN_PROCESS_BYTES:
            result = await anyio.to_thread.run_sync(pool.run, job, limiter=detokenizing)
        else:  # a small body, or a tokenizer that cannot go to a worker (tests' fakes): the same, in a thread
            result = await anyio.to_thread.run_sync(
                answer, job, engine.tokenizer.decode, engine.tokenizer.vocab_size, limiter=detokenizing
            )
        return Response(result.body, status_code=result.status, media_type="application/json")
