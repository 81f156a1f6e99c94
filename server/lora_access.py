"""Which LoRA adapters a tenant may use: the optional third field of a `--tenants` line, `loras=NAME,NAME`.

`acme 9f86d0... loras=acme-tone,shared-extractor` limits tenant `acme` to those adapters (and the base
model); `loras=` (empty) to none; a tenant whose lines carry no such field may use every adapter. Several lines
of one tenant (key rotation) must agree: the union of their lists would let an old line widen a new one.
Requests without a tenant (the operator's key, or a server without --tenants) may use every adapter.
An adapter a tenant may not use does not exist for it (server.lora_routes answers the unknown model's 404).
"""

from __future__ import annotations

from fastapi import Request

from server.auth import TENANT_SCOPE_KEY

FIELD = "loras="


def parse_loras_field(field: str) -> frozenset[str] | None:
    """The adapter names of a `loras=a,b` field; None when `field` is not one."""
    if not field.startswith(FIELD):
        return None
    return frozenset(n for n in field[len(FIELD) :].split(",") if n)


def parse_tenant_loras(text: str) -> dict[str, frozenset[str]]:
    """{tenant: the adapters it may use} for the tenants whose lines limit them (a tenants file's text, already
    checked by server.tenants.parse_tenants); ValueError where one tenant's lines disagree."""
    out: dict[str, frozenset[str] | None] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        fields = raw.split()
        if len(fields) < 2 or fields[0].startswith("#"):
            continue
        names = parse_loras_field(fields[2]) if len(fields) == 3 else None
        tenant = fields[0]
        if tenant in out and out[tenant] != names:
            raise ValueError(
                f"tenants file, line {lineno}: this tenant's loras= differs from its earlier line"
            )
        out[tenant] = names
    return {t: names for t, names in out.items() if names is not None}


def tenant_may_use_adapter(request: Request, name: str) -> bool:
    tenant = request.scope.get(TENANT_SCOPE_KEY)
    if tenant is None:
        return True
    tenancy = getattr(request.app.state, "tenancy", None)
    allowed = getattr(tenancy, "tenant_loras", None) or {}
    names = allowed.get(tenant)
    return names is None or name in names
