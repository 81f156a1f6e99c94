"""The `--tenants` file (which API key is which tenant) and `brine tenant-key`, which makes a key for one.

The file is plain text, one tenant key per line: the tenant id, whitespace, and the lowercase hex SHA-256 of
the key (`acme 9f86d0...`), optionally followed by the LoRA adapters the tenant may use (`loras=a,b`,
server.lora_access). Blank lines and lines starting with `#` are ignored. It holds no secrets: only the
keys' hashes. A tenant may have several lines (several keys, for rotation); one key cannot belong to two
tenants. A malformed line refuses the whole file, naming its line number (never its content: an id in a log
would name a tenant).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from pathlib import Path

MAX_TENANT_ID_CHARS = 1024  # the cache_salt limit: a tenant id is a namespace like a salt
_HEX64 = re.compile(r"[0-9a-f]{64}")
KEY_PREFIX = "sk-brine-"


class TenantsFileError(ValueError):
    """The tenants file cannot be used; the message names the file and the line."""


def key_hash(key: str | bytes) -> str:
    """The lowercase hex SHA-256 of an API key, as the tenants file lists it."""
    return hashlib.sha256(key.encode() if isinstance(key, str) else key).hexdigest()


def check_tenant_id(tenant: str) -> str | None:
    """Why `tenant` cannot be a tenant id, or None when it can."""
    if not tenant:
        return "a tenant id must not be empty"
    if len(tenant) > MAX_TENANT_ID_CHARS:
        return f"a tenant id must be at most {MAX_TENANT_ID_CHARS} characters long"
    if any(c.isspace() for c in tenant):
        return "a tenant id must not contain whitespace"
    if tenant.startswith("#"):
        return "a tenant id must not start with '#' (the line would be a comment)"
    if not tenant.isprintable():
        return "a tenant id must be printable"
    return None


def parse_tenants(text: str, source: str = "tenants file") -> dict[str, str]:
    """{sha256 hex of a key: tenant id} from the file's text; TenantsFileError on the first bad line."""
    tenants: dict[str, str] = {}
    for lineno, raw in enumerate(text.splitlines(), start=1):
        line = raw.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        # A third field may limit the tenant's LoRA adapters (server.lora_access: loras=NAME,NAME).
        if len(fields) == 3 and not fields[2].startswith("loras="):
            raise TenantsFileError(
                f"{source}, line {lineno}: the third field, if any, must be loras=NAME,..."
            )
        if len(fields) not in (2, 3):
            raise TenantsFileError(
                f"{source}, line {lineno}: expected 'TENANT SHA256HEX [loras=NAME,...]', found {len(fields)} fields"
            )
        tenant, digest = fields[:2]
        problem = check_tenant_id(tenant)
        if problem is not None:
            raise TenantsFileError(f"{source}, line {lineno}: {problem}")
        if not _HEX64.fullmatch(digest):
            raise TenantsFileError(
                f"{source}, line {lineno}: the second field must be the lowercase hex SHA-256 of the key "
                "(64 characters 0-9a-f); `brine tenant-key TENANT` prints a valid line"
            )
        if tenants.get(digest, tenant) != tenant:
            raise TenantsFileError(
                f"{source}, line {lineno}: this key hash already belongs to another tenant"
            )
        tenants[digest] = tenant
    return tenants


def load_tenants(path: str | Path) -> dict[str, str]:
    """parse_tenants of the file at `path`; TenantsFileError when it cannot be read or parsed."""
    try:
        text = Path(path).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise TenantsFileError(f"cannot read the tenants file {path}: {exc}") from None
    return parse_tenants(text, str(path))


def new_tenant_key(tenant: str) -> tuple[str, str]:
    """(a fresh random API key, the tenants-file line for it). ValueError for an invalid tenant id."""
    problem = check_tenant_id(tenant)
    if problem is not None:
        raise ValueError(problem)
    key = KEY_PREFIX + secrets.token_urlsafe(32)  # 256 random bits
    return key, f"{tenant} {key_hash(key)}"
