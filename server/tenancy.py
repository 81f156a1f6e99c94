"""The cache namespace of one HTTP request: from the tenant's API key, the trusted gateway header, the body's
`cache_salt`, and the server's rules for them (`TenancyConfig`).

- A tenant's key (`--tenants`, see server.auth) puts the request in that tenant's namespace; the body's
  `cache_salt` partitions further inside it.
- `--salt-header NAME`: for requests not authenticated by a tenant key, the namespace comes from that header,
  which a gateway in front of Brine sets from its own authentication. It obeys the `cache_salt` rules; a
  generation request without it is a 400. Only safe behind a gateway that strips it from client requests.
- `--require-cache-salt`: a generation request with no namespace at all (no tenant key, no gateway header, no
  `cache_salt`) is a 400 with `param: "cache_salt"`.
Messages name the rule and the header, never a value.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from fastapi import Request

from kv_cache.namespace import CacheNamespace, Owner
from server.auth import TENANT_SCOPE_KEY
from server.errors import bad_request

MAX_NAMESPACE_CHARS = 1024  # the cache_salt limit
# An HTTP field name (RFC 9110 token).
_HEADER_NAME = re.compile(r"[!#$%&'*+\-.^_`|~0-9A-Za-z]+")


@dataclass(slots=True)
class TenancyConfig:
    """The server's tenancy flags. `tenants`: {hex SHA-256 of a key: tenant id}, None without `--tenants`."""

    tenants: dict[str, str] | None = None
    salt_header: str | None = None
    require_cache_salt: bool = False
    # {tenant: the LoRA adapters it may use} for tenants whose lines limit them (server.lora_access).
    tenant_loras: dict[str, frozenset[str]] | None = None

    def __post_init__(self) -> None:
        if self.salt_header is not None:
            if not _HEADER_NAME.fullmatch(self.salt_header):
                raise ValueError(f"--salt-header {self.salt_header!r} is not a valid HTTP header name")
            if self.salt_header.lower() == "authorization":
                raise ValueError("--salt-header cannot be the Authorization header")
            self.salt_header = self.salt_header.lower()


def _gateway_value(request: Request, config: TenancyConfig, required: bool) -> str | None:
    header = config.salt_header
    if header is None:
        return None
    values = request.headers.getlist(header)
    if len(values) > 1:
        # Which one would be the gateway's? A gateway that appends its header instead of replacing the
        # client's would let the client pick the namespace, if the first one won (as it did).
        raise bad_request(f"The {header} header must be sent once.", param=header, code="invalid_header")
    value = values[0] if values else None
    if value is None:
        if required:
            raise bad_request(
                f"This server requires the {header} header.", param=header, code="missing_header"
            )
        return None
    if not value:
        raise bad_request(f"The {header} header must not be empty.", param=header, code="invalid_header")
    if len(value) > MAX_NAMESPACE_CHARS:
        raise bad_request(
            f"The {header} header must be at most {MAX_NAMESPACE_CHARS} characters long.",
            param=header,
            code="invalid_header",
        )
    return value


def request_namespace(request: Request, salt: str | None) -> CacheNamespace | None:
    """The cache namespace of a generation request whose (validated) body salt is `salt`; None for the
    shared unsalted namespace. Raises the 400s described in the module docstring."""
    config: TenancyConfig = getattr(request.app.state, "tenancy", None) or TenancyConfig()
    tenant: str | None = request.scope.get(TENANT_SCOPE_KEY)
    gateway = _gateway_value(request, config, required=True) if tenant is None else None
    if tenant is None and gateway is None and salt is None:
        if config.require_cache_salt:
            raise bad_request(
                "This server requires a cache namespace: send cache_salt (or use a tenant's API key).",
                param="cache_salt",
                code="missing_cache_salt",
            )
        return None
    return CacheNamespace(tenant=tenant, gateway=gateway, salt=salt)


def request_owner(request: Request) -> Owner | None:
    """Whose cache a `POST /reset_prefix_cache` may reset: the tenant of a tenant key, or the gateway
    header's namespace when the header is configured and present; None (a global reset, the operator's)."""
    config: TenancyConfig = getattr(request.app.state, "tenancy", None) or TenancyConfig()
    tenant: str | None = request.scope.get(TENANT_SCOPE_KEY)
    if tenant is not None:
        return CacheNamespace(tenant=tenant).owner
    gateway = _gateway_value(request, config, required=False)
    return CacheNamespace(gateway=gateway).owner if gateway is not None else None
