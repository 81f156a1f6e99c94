"""The FastAPI application: `create_app(engine, ...)` wires the routes, error handlers and auth.

The engine is anything satisfying `server.engine_client.EngineClient` (the real `AsyncEngine`, or the fake in
tests). Routes hold no state of their own beyond what `create_app` closes over.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Sequence
from typing import Any, Protocol

import anyio
from fastapi import FastAPI, Query, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from server.auth import ApiKeyMiddleware
from server.body_limit import MAX_BODY_BYTES, BodyLimitMiddleware
from server.engine_client import EngineClient, TokenizerLike
from server.errors import APIError, bad_request, engine_not_running, install_error_handlers
from server.generation import ClientDisconnected
from server.inflight import InflightLimiter
from server.limits import RequestLimits
from server.lora_routes import adapter_cards, add_lora_routes, find_adapter_card
from server.messages_routes import install_messages_routes
from server.openapi import BODY_ERRORS, GENERATION_RESPONSES, install_openapi
from server.params import check_chat_template, check_model
from server.prompts import encode, off_loop, render_chat
from server.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from server.response_store import ResponseStore
from server.responses import now
from server.router_routes import install_router_routes
from server.serving_chat import create_chat_completion
from server.serving_completion import create_completion
from server.serving_responses import install_responses_routes
from server.tenancy import TenancyConfig, request_owner
from server.text_check import check_text

DETOKENIZE_THREADS = 2


def _decode(tokenizer: TokenizerLike, tokens: list[int]) -> str:
    """`/detokenize`'s work, in a worker thread: the vocabulary check is a pass over every id too."""
    vocab = tokenizer.vocab_size
    if any(t < 0 or (vocab is not None and t >= vocab) for t in tokens):
        raise bad_request("tokens contains a token id outside the vocabulary.", "tokens")
    return tokenizer.decode(tokens)


class MetricsRenderer(Protocol):
    def render(self) -> tuple[bytes, str]: ...


_FASTAPI_PARAMS = inspect.signature(FastAPI).parameters


def _version() -> str:
    try:
        return importlib.metadata.version("brine")
    except importlib.metadata.PackageNotFoundError:
        return "0.0.0+unknown"


def create_app(
    engine: EngineClient,
    *,
    api_keys: Sequence[str] = (),
    metrics: MetricsRenderer | None = None,
    max_body_bytes: int = MAX_BODY_BYTES,
    tenancy: TenancyConfig | None = None,
    limits: RequestLimits | None = None,
    response_store: ResponseStore | None = None,
) -> FastAPI:
    """The OpenAI-compatible app over `engine`.

    api_keys: the operator's keys. When there are any (or tenants), every route but `GET`/`HEAD /health` needs
        `Authorization: Bearer <key>` (`/docs` and `/openapi.json` included).
    tenancy: tenants' keys, the gateway header and --require-cache-salt (server.tenancy); default: none.
    metrics: what `GET /metrics` renders (a `metrics.prometheus.PrometheusStatLogger`); empty body if None.
    max_body_bytes: larger request bodies are refused with a 413 before they are read whole.
    limits: what one generation request may ask for (`server.limits`); the defaults when None.
    response_store: where `/v1/responses` keeps stored responses (`server.response_store`); a default one.
    """
    # A body sent without a Content-Type is still read as JSON, as Brine always did (older FastAPI too).
    lenient: dict[str, Any] = (
        {"strict_content_type": False} if "strict_content_type" in _FASTAPI_PARAMS else {}
    )
    app = FastAPI(
        title="Brine",
        version=_version(),
        summary="OpenAI-compatible LLM inference with prefix caching and per-tenant cache salts.",
        docs_url="/docs",
        redoc_url=None,
        **lenient,
    )
    tenancy = tenancy or TenancyConfig()
    app.state.tenancy = tenancy
    install_error_handlers(app)
    install_openapi(app)
    # Added last = outermost: a request without a valid key is refused before its body is read.
    # /detokenize's body is bounded by its token limit (12 bytes an id, at most: 10 digits and ", "), so a body
    # far past it is refused before FastAPI parses it on the event loop.
    detokenize_bytes = min(max_body_bytes, 4096 + 12 * (limits or RequestLimits()).max_detokenize_tokens)
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=max_body_bytes, path_limits={"/detokenize": detokenize_bytes}
    )
    # Always installed: with no keys (and no tenants) it lets HTTP through, and still refuses WebSockets and
    # other scopes.
    app.add_middleware(ApiKeyMiddleware, api_keys=list(api_keys), tenants=tenancy.tenants)
    keyless = not any(api_keys) and tenancy.tenants is None  # every caller is anonymous
    app.state.limits = limits or RequestLimits()
    app.state.inflight = InflightLimiter(app.state.limits.max_requests_per_namespace)
    created = now()

    @app.exception_handler(ClientDisconnected)
    @app.exception_handler(ClientDisconnect)  # gone while sending its body: not a server error either
    async def _client_gone(_: Request, __: Exception) -> Response:
        # Nobody reads this; 499 (nginx's "client closed request") keeps it out of 5xx dashboards.
        return Response(status_code=499)

    def require_healthy() -> None:
        if not engine.is_healthy():
            raise engine_not_running()

    @app.post("/v1/chat/completions", operation_id="createChatCompletion", responses=GENERATION_RESPONSES)
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        require_healthy()
        return await create_chat_completion(engine, body, request)

    @app.post("/v1/completions", operation_id="createCompletion", responses=GENERATION_RESPONSES)
    async def completions(body: CompletionRequest, request: Request) -> Response:
        require_healthy()
        return await create_completion(engine, body, request)

    def model_card() -> dict:
        return {
            "id": engine.model_name,
            "object": "model",
            "created": created,
            "owned_by": "brine",
            "max_model_len": engine.max_model_len,
        }

    @app.get("/v1/models", operation_id="listModels")
    async def list_models(request: Request) -> dict:
        # LoRA adapters follow the base model, as vLLM lists them (only those this caller may use).
        return {"object": "list", "data": [model_card(), *adapter_cards(engine, request, created)]}

    @app.get("/v1/models/{model_id:path}", operation_id="retrieveModel")
    async def retrieve_model(model_id: str, request: Request) -> dict:
        adapter = find_adapter_card(engine, request, model_id, created)
        if adapter is not None:
            return adapter
        check_model(model_id, engine.model_name)
        return model_card()

    add_lora_routes(app, engine)

    @app.get("/health", operation_id="health")
    async def health() -> Response:
        if engine.is_healthy():
            return Response(status_code=200)
        return engine_not_running().response()

    # HEAD too: load balancers probe with it (the server sends the GET answer's status and headers only).
    app.head("/health", include_in_schema=False)(health)

    @app.get("/version", operation_id="version")
    async def version() -> dict:
        return {"version": _version()}

    @app.get("/metrics", operation_id="metrics")
    async def get_metrics() -> Response:
        if metrics is None:
            return Response(b"", media_type="text/plain; version=0.0.4; charset=utf-8")
        body, content_type = metrics.render()
        return Response(body, media_type=content_type)

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

    @app.post("/reset_prefix_cache", operation_id="resetPrefixCache")
    async def reset_prefix_cache(
        request: Request,
        # Checked below rather than typed as a Literal: a bad value must be a 400 naming `scope`.
        scope: str | None = Query(
            None,
            description='"tenant": the caller\'s own cached blocks (a tenant key\'s default); "global": every '
            "cached block (the operator's default; a tenant gets a 403).",
            json_schema_extra={"enum": ["tenant", "global"]},
        ),
    ) -> dict:
        # ?scope=tenant|global; the default is the caller's own: a tenant's (or the gateway header's)
        # namespace, else everything. Only the operator may reset everything.
        if scope not in (None, "tenant", "global"):
            raise bad_request('scope must be "tenant" or "global".', "scope")
        owner = request_owner(request)
        if owner is not None and scope == "global":
            raise APIError(
                "Only the server's operator can reset the whole prefix cache; this resets your own blocks "
                "without scope=global.",
                status=403,
                code="permission_denied",
            )
        if owner is None and scope == "tenant":
            raise bad_request(
                "A tenant-scoped reset needs a tenant's API key (or the gateway header).", "scope"
            )
        if owner is not None:
            # A tenant's reset: its own private blocks only, in use or not (never refused with a 409).
            forgotten = await anyio.to_thread.run_sync(engine.forget_prefix_cache, owner)
            return {"reset": True, "forgotten_blocks": forgotten}
        # The real engine waits for the current step to end: keep that wait off the event loop. On a server
        # without keys anyone may ask, so a 409 would tell any caller that others are running: there the
        # reset is forced (blocks in use lose their hashes and keep serving) and always succeeds.
        if not await anyio.to_thread.run_sync(engine.reset_prefix_cache, keyless):
            raise APIError(
                "The prefix cache cannot be reset while requests hold KV blocks; retry when idle.",
                status=409,
                code="prefix_cache_in_use",
            )
        return {"reset": True}

    install_responses_routes(app, engine, response_store or ResponseStore())
    install_router_routes(app, engine)
    install_messages_routes(app, engine)  # last: its error middleware must be outermost
    return app
