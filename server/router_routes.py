"""The routes a cache-aware router asks a worker for, beyond the OpenAI API: vllm-router's and sglang-router's.

- `GET /get_server_info`: who this replica is (model, a per-process instance id) and the KV geometry a router
  indexes by: block size, context length, KV capacity in blocks.
- `GET /get_model_info`: sglang-router's model lookup (without it, it lists the model as "unknown").
- `GET /kv_event_sources`: where this replica publishes its KV events, keyed by data-parallel rank (as a
  string), each entry in vLLM's KVEventsConfig fields; `{}` when `--kv-events-endpoint` is off.
- `POST /v1/completions/render`, `POST /v1/chat/completions/render`: the prompt token ids a request would run,
  without generating (vLLM's GenerateRequest shape: a list of them for completions, one for chat). Validated
  exactly as the generating route would be, so a request the route would refuse gets the same 4xx here.

All of them sit behind `--api-key` like every route; a tenant's key cannot call them (`server.auth`): they are
the router's, which authenticates with an operator key.
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from fastapi import FastAPI, Request

from server.engine_client import EngineClient
from server.openapi import BODY_ERRORS
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.responses import new_id
from server.serving_chat import prepare_chat
from server.serving_completion import prepare_completion


def _generate_request(
    engine: EngineClient, request_id: str, token_ids: list[int], params: Any, stream: bool | None
) -> dict[str, Any]:
    return {
        "request_id": request_id,
        "token_ids": token_ids,
        "sampling_params": dataclasses.asdict(params),
        "model": engine.model_name,
        "stream": bool(stream),
        "token_offsets": None,
    }


def install_router_routes(app: FastAPI, engine: EngineClient) -> None:
    # One per process: a router keys a replica's events by it, so two replicas must never share one.
    instance_id = f"brine-{uuid.uuid4().hex}"

    @app.get("/get_server_info", operation_id="getServerInfo")
    async def get_server_info() -> dict[str, Any]:
        return {
            "model_id": engine.model_name,
            "model_path": engine.model_name,
            "instance_id": instance_id,
            "kv_block_size": engine.block_size,
            "max_model_len": engine.max_model_len,
            "num_gpu_blocks": engine.num_blocks,  # vLLM's name for the KV capacity in blocks
            "enable_prefix_caching": engine.enable_prefix_caching,
        }

    @app.get("/get_model_info", operation_id="getModelInfo")
    async def get_model_info() -> dict[str, Any]:
        return {
            "model_path": engine.model_name,
            "tokenizer_path": engine.model_name,
            "is_generation": True,
            "max_model_len": engine.max_model_len,
        }

    @app.get("/kv_event_sources", operation_id="getKvEventSources")
    async def kv_event_sources() -> dict[str, dict[str, Any]]:
        return engine.kv_event_sources()

    @app.post("/v1/completions/render", operation_id="renderCompletion", responses=BODY_ERRORS)
    async def render_completion(req: CompletionRequest, request: Request) -> list[dict[str, Any]]:
        prep = await prepare_completion(engine, req, request)  # the generating route's checks
        prompts, params = prep.prompts, prep.params
        request_id = new_id("cmpl")
        return [
            _generate_request(engine, f"{request_id}-{i}", p, params, req.stream)
            for i, p in enumerate(prompts)
        ]

    @app.post("/v1/chat/completions/render", operation_id="renderChatCompletion", responses=BODY_ERRORS)
    async def render_chat_completion(req: ChatCompletionRequest, request: Request) -> dict[str, Any]:
        prep = await prepare_chat(engine, req, request)  # the generating route's checks
        return _generate_request(engine, new_id("chatcmpl"), prep.prompts[0], prep.params, req.stream)
