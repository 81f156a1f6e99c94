"""Cache namespaces: who may share a cached block with whom, and which prompt prefixes everyone may share.

A request's `CacheNamespace` is set by the server (never by the engine) from three sources, each its own typed
key in the block hash, so a value of one kind can never collide with a value of another:
- `tenant`: the tenant whose API key (from `--tenants`) authenticated the request: `("tenant", id)`;
- `gateway`: the value of the trusted gateway header (`--salt-header`): `("gateway", value)`;
- `salt`: the body's `cache_salt`, partitioning further inside the tenant: `("cache_salt", salt)`;
- `lora`: the LoRA adapter the request runs (its name and content fingerprint): `("lora", name, fingerprint)`.
  An adapter changes the K and V of every layer it touches (and of every later one), so its blocks are never
  another adapter's or the base model's, public prefixes included (`KVCacheManager.make_hasher`).
The namespace's keys go into the extra keys of the request's first private block (block 0 unless a public
prefix comes first) and every later block inherits them through its parent hash.

`PublicPrefixes` holds the token ids of the prefixes the operator declared public (`--public-prefix`). A prompt
that starts with one of them (the longest wins) hashes the blocks lying wholly inside it without any
namespace key, so every namespace shares them; the block that straddles the boundary and every later block
are private. Invariant: a block shared across namespaces holds only tokens of a declared public prefix, at
the positions they have in it.

Nothing here is ever logged, exported as a metric label or put in a KV event: it names tenants.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

# The owner of a private block, for a tenant-scoped reset: ("tenant", id) or ("gateway", value).
Owner = tuple[str, str]


@dataclass(frozen=True, slots=True)
class CacheNamespace:
    """The cache namespace of one request. All None: the shared unsalted namespace."""

    tenant: str | None = None
    gateway: str | None = None
    salt: str | None = None
    lora: tuple[str, str] | None = None  # (adapter name, content fingerprint)

    def keys(self) -> tuple[tuple[str, ...], ...]:
        """The typed extra keys of the first private block, in a fixed order (tenant, gateway, salt, lora)."""
        out: list[tuple[str, ...]] = []
        if self.tenant is not None:
            out.append(("tenant", self.tenant))
        if self.gateway is not None:
            out.append(("gateway", self.gateway))
        if self.salt is not None:
            out.append(("cache_salt", self.salt))
        if self.lora is not None:
            out.append(("lora", *self.lora))
        return tuple(out)

    @property
    def owner(self) -> Owner | None:
        """Whose blocks these are for a tenant-scoped reset (None: nobody's; only a global reset forgets
        them). The salt is not an owner: a tenant forgets all its blocks, whatever salts it used."""
        if self.tenant is not None:
            return ("tenant", self.tenant)
        if self.gateway is not None:
            return ("gateway", self.gateway)
        return None

    @property
    def holder(self) -> tuple[str, str | None]:
        """Whom a share of a pooled resource (retained blocks: kv_cache.retention) is counted for: the tenant,
        else the trusted gateway's value, else the salt (None: the unsalted namespace); the scheduler's fair
        shares too (engine.request.fair_share_key). Never the adapter, nor a tenant's salts: a tenant cannot
        buy more shares by rotating them (with salt-only tenancy, a client that rotates salts does)."""
        return self.owner or ("cache_salt", self.salt)

    def __repr__(self) -> str:
        # Never print the values: a namespace that reaches a log or an exception message must not name anyone.
        kinds = [
            k
            for k, v in (
                ("tenant", self.tenant),
                ("gateway", self.gateway),
                ("salt", self.salt),
                ("lora", self.lora),
            )
            if v
        ]
        return f"CacheNamespace({', '.join(kinds) or 'unsalted'})"


class PublicPrefixes:
    """The declared public prefixes (token ids), and the longest one a prompt starts with."""

    __slots__ = ("_by_first", "prefixes")

    def __init__(self, prefixes: Iterable[Sequence[int]] = ()) -> None:
        unique = {tuple(p) for p in prefixes if p}
        # Longest first, so the first match is the longest; grouped by first token to skip most at once.
        self.prefixes: tuple[tuple[int, ...], ...] = tuple(sorted(unique, key=len, reverse=True))
        self._by_first: dict[int, list[tuple[int, ...]]] = {}
        for p in self.prefixes:
            self._by_first.setdefault(p[0], []).append(p)

    def __len__(self) -> int:
        return len(self.prefixes)

    def match(self, token_ids: Sequence[int]) -> int:
        """Length of the longest declared prefix that `token_ids` starts with (all of it); 0 if none."""
        if not token_ids:
            return 0
        n = len(token_ids)
        for p in self._by_first.get(token_ids[0], ()):
            if len(p) <= n and tuple(token_ids[: len(p)]) == p:
                return len(p)
        return 0
