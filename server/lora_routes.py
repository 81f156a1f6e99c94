"""LoRA adapters on the server side: which adapter a request's `model` names, what `/v1/models` lists, and the
operator's `POST /v1/load_lora_adapter` and `POST /v1/unload_lora_adapter` (vLLM's shapes and answers).

- A request's `model` may be the base model's name or a loaded adapter's (`brine serve --enable-lora`). The
  adapter becomes the `lora` key of the request's cache namespace: `("lora", name, fingerprint)`, typed like
  the tenant and salt keys, so it can never collide with them (kv_cache.namespace).
- Tenants (`--tenants`, a line's `loras=a,b` field: server.lora_access) may be limited to some adapters. An
  adapter a tenant may not use is, for that tenant, a model that does not exist: the same 404 as an unknown
  name, in generation and in `/v1/models`, so a tenant cannot learn that another tenant's adapter exists.
- The load and unload routes are not tenant routes (server.auth), so only the operator's key opens them.
  Loading reads and checks the files on a worker thread, never on the event loop.
"""

from __future__ import annotations

import asyncio
import dataclasses
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import PlainTextResponse
from pydantic import BaseModel, ConfigDict

from engine.lora.peft_format import LoRAError
from kv_cache.namespace import CacheNamespace
from server.engine_client import EngineClient
from server.errors import APIError, bad_request
from server.lora_access import tenant_may_use_adapter
from server.params import check_model


class LoadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_path: str
    # vLLM's: replace an adapter already loaded under this name (its old KV is never reused: another
    # fingerprint); without it, loading a name in use is a 400.
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    lora_name: str
    lora_int_id: int | None = None  # accepted for vLLM's clients; the name decides


def lora_manager(engine: EngineClient) -> Any:
    """The engine's `engine.lora.manager.LoRAManager`, None where LoRA is off (or the engine has none)."""
    return getattr(engine, "loras", None)


def select_adapter(engine: EngineClient, request: Request, requested: str | None) -> tuple[str, str] | None:
    """The (name, fingerprint) of the adapter `requested` names, None for the base model; the 404 of an
    unknown model for anything else, adapters this caller may not use included."""
    if requested is None or requested == engine.model_name:
        return None
    manager = lora_manager(engine)
    adapter = manager.get(requested) if manager is not None else None
    if adapter is None or not tenant_may_use_adapter(request, adapter.name):
        check_model(requested, engine.model_name)  # raises the model-not-found 404
    assert adapter is not None  # check_model raised for any name but the base model's
    return adapter.key


def with_adapter(namespace: CacheNamespace | None, key: tuple[str, str] | None) -> CacheNamespace | None:
    """`namespace` with its `lora` key set (a namespace of its own when the request had none)."""
    if key is None:
        return namespace
    return dataclasses.replace(namespace or CacheNamespace(), lora=key)


def adapter_cards(engine: EngineClient, request: Request, created: int) -> list[dict[str, Any]]:
    """The `/v1/models` entries of the adapters this caller may use, in load order (vLLM's fields)."""
    manager = lora_manager(engine)
    if manager is None:
        return []
    return [
        adapter_card(engine, a.name, created)
        for a in manager.adapters()
        if tenant_may_use_adapter(request, a.name)
    ]


def adapter_card(engine: EngineClient, name: str, created: int) -> dict[str, Any]:
    return {
        "id": name,
        "object": "model",
        "created": created,
        "owned_by": "brine",
        "parent": engine.model_name,
        "max_model_len": engine.max_model_len,
    }


def find_adapter_card(engine: EngineClient, request: Request, model_id: str, created: int) -> dict | None:
    manager = lora_manager(engine)
    adapter = manager.get(model_id) if manager is not None else None
    if adapter is None or not tenant_may_use_adapter(request, adapter.name):
        return None
    return adapter_card(engine, adapter.name, created)


def add_lora_routes(app: FastAPI, engine: EngineClient) -> None:
    """The operator's load and unload routes, where the engine serves adapters (`--enable-lora`)."""
    manager = lora_manager(engine)
    if manager is None:
        return

    @app.post("/v1/load_lora_adapter", operation_id="loadLoraAdapter", response_class=PlainTextResponse)
    async def load_lora_adapter(body: LoadLoRAAdapterRequest) -> PlainTextResponse:
        if body.lora_name == engine.model_name:
            raise bad_request("An adapter cannot take the base model's name.", "lora_name")
        try:
            await asyncio.to_thread(manager.load, body.lora_name, body.lora_path, body.load_inplace)
        except LoRAError as exc:
            raise bad_request(f"Cannot load the LoRA adapter: {exc}.", exc.param) from None
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter", operation_id="unloadLoraAdapter", response_class=PlainTextResponse)
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest) -> PlainTextResponse:
        if not manager.unload(body.lora_name):
            shown = body.lora_name if len(body.lora_name) <= 100 else body.lora_name[:100] + "..."
            raise APIError(
                f"The lora adapter '{shown}' cannot be found.",
                status=404,
                param="lora_name",
                code="not_found",
            )
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")
