"""`--kv-cache-memory`'s sizes ("2GiB", "512MiB", "1.5GB", bytes) as a number of bytes: string parsing only."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    "ki": 2**10,
    "mi": 2**20,
    "gi": 2**30,
    "ti": 2**40,
}
_MEMORY_RE = re.compile(r"\s*(\d+(?:\.\d*)?|\.\d+)\s*([a-zA-Z]*)\s*")


def parse_memory(text: str) -> int:
    """Bytes in "2GiB", "512MiB", "1.5GB", "1000000" (units are case-insensitive: B, KB/MB/GB/TB powers of
    1000, KiB/MiB/GiB/TiB or Ki/Mi/Gi/Ti powers of 1024). Fractions of a byte are dropped. ValueError otherwise."""
    m = _MEMORY_RE.fullmatch(text) if isinstance(text, str) else None
    unit = _UNITS.get(m.group(2).lower()) if m else None
    if m is None or unit is None:
        raise ValueError(f"invalid memory size {text!r}: expected e.g. '2GiB', '512MiB', '1.5GB' or bytes")
    try:
        return int(Decimal(m.group(1)) * unit)
    except InvalidOperation as e:  # pragma: no cover - the regex admits only decimals
        raise ValueError(f"invalid memory size {text!r}") from e
