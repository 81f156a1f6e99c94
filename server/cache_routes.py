"""`POST /reset_prefix_cache[?scope=tenant|global]`: forget cached KV blocks. A tenant (a tenant's key, or
the gateway header) resets its own private blocks only; the operator resets everything, and where the server
has no keys at all anyone is the operator, so the reset is forced rather than telling a caller that others
are running."""

from __future__ import annotations

import anyio
from fastapi import FastAPI, Query, Request

from server.engine_client import EngineClient
from server.errors import APIError, bad_request
from server.tenancy import request_owner


def install_cache_routes(app: FastAPI, engine: EngineClient, *, keyless: bool) -> None:
    """keyless: the server has no API keys and no tenants (every caller is anonymous)."""

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
