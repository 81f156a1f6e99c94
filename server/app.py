"""The FastAPI application: `create_app(engine, ...)` wires the routes, error handlers and auth.

The engine is anything satisfying `server.engine_client.EngineClient` (the real `AsyncEngine`, or the fake in
tests). `create_app` builds the app, its state and middleware, then installs one route group at a time: the
generation, model and ops (/health, /version, /metrics) routes here, the others from their own modules
(`token_routes`, `cache_routes`, `lora_routes`, `serving_responses`, `router_routes`, `messages_routes`).
Routes hold no state of their own beyond what their installer closes over.
"""

from __future__ import annotations

import importlib.metadata
import inspect
from collections.abc import Sequence
from typing import Any, Protocol

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.requests import ClientDisconnect

from server.auth import ApiKeyMiddleware
from server.body_limit import MAX_BODY_BYTES, BodyLimitMiddleware
from server.cache_routes import install_cache_routes
from server.engine_client import EngineClient
from server.errors import UnexpectedErrorMiddleware, engine_not_running, install_error_handlers
from server.generation import ClientDisconnected
from server.inflight import InflightLimiter
from server.limits import RequestLimits
from server.lora_routes import adapter_cards, add_lora_routes, find_adapter_card
from server.messages_routes import install_messages_routes
from server.openapi import GENERATION_RESPONSES, install_openapi
from server.params import check_model
from server.protocol import ChatCompletionRequest, CompletionRequest
from server.response_store import ResponseStore
from server.responses import now
from server.router_routes import install_router_routes
from server.serving_chat import create_chat_completion
from server.serving_completion import create_completion
from server.serving_responses import install_responses_routes
from server.tenancy import TenancyConfig
from server.token_routes import install_token_routes


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
    app.state.limits = limits or RequestLimits()
    app.state.inflight = InflightLimiter(app.state.limits.max_requests_per_namespace)
    install_error_handlers(app)
    install_openapi(app)
    _install_middleware(app, api_keys, tenancy, max_body_bytes)
    _install_client_gone(app)
    # In this order: it is the order of /openapi.json's paths.
    _install_generation_routes(app, engine)
    _install_model_routes(app, engine, created=now())
    add_lora_routes(app, engine)
    _install_ops_routes(app, engine, metrics)
    install_token_routes(app, engine)
    install_cache_routes(app, engine, keyless=not any(api_keys) and tenancy.tenants is None)
    install_responses_routes(app, engine, response_store or ResponseStore())
    install_router_routes(app, engine)
    install_messages_routes(app, engine)  # last: its error middleware must be outermost
    return app


def _install_middleware(
    app: FastAPI, api_keys: Sequence[str], tenancy: TenancyConfig, max_body_bytes: int
) -> None:
    # Added last = outermost: a request without a valid key is refused before its body is read.
    # /detokenize's body is bounded by its token limit (12 bytes an id, at most: 10 digits and ", "), so a body
    # far past it is refused before FastAPI parses it on the event loop.
    detokenize_bytes = min(max_body_bytes, 4096 + 12 * app.state.limits.max_detokenize_tokens)
    app.add_middleware(UnexpectedErrorMiddleware)  # first = innermost (server.errors says why)
    app.add_middleware(
        BodyLimitMiddleware, max_bytes=max_body_bytes, path_limits={"/detokenize": detokenize_bytes}
    )
    # Always installed: with no keys (and no tenants) it lets HTTP through, and still refuses WebSockets and
    # other scopes.
    app.add_middleware(ApiKeyMiddleware, api_keys=list(api_keys), tenants=tenancy.tenants)


def _install_client_gone(app: FastAPI) -> None:
    @app.exception_handler(ClientDisconnected)
    @app.exception_handler(ClientDisconnect)  # gone while sending its body: not a server error either
    async def _client_gone(_: Request, __: Exception) -> Response:
        # Nobody reads this; 499 (nginx's "client closed request") keeps it out of 5xx dashboards.
        return Response(status_code=499)


def _install_generation_routes(app: FastAPI, engine: EngineClient) -> None:
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


def _install_model_routes(app: FastAPI, engine: EngineClient, *, created: int) -> None:
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


def _install_ops_routes(app: FastAPI, engine: EngineClient, metrics: MetricsRenderer | None) -> None:
    """What load balancers, operators and scrapers ask: /health, /version, /metrics."""

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
