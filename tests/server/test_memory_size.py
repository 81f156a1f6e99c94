"""parse_memory: the sizes `--kv-cache-memory` accepts, and the ones it refuses."""

from __future__ import annotations

import pytest

from server.memory_size import parse_memory


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("2GiB", 2 * 2**30),
        ("512MiB", 512 * 2**20),
        ("1.5GB", 1_500_000_000),
        ("1000000", 1_000_000),
        ("4 gib", 4 * 2**30),
        ("8Gi", 8 * 2**30),
        ("1.5KiB", 1536),
        ("10kb", 10_000),
        ("0.1GB", 100_000_000),
        ("3B", 3),
        (" 7TB ", 7 * 10**12),
        (".5MiB", 2**19),
    ],
)
def test_parse_memory(text: str, expected: int) -> None:
    assert parse_memory(text) == expected


@pytest.mark.parametrize(
    "text", ["", "GiB", "-1GiB", "2 GiBs", "1e9", "2 G B", "nan", "inf", "1,000", "2Gb!"]
)
def test_parse_memory_rejects(text: str) -> None:
    with pytest.raises(ValueError):
        parse_memory(text)
