"""The disk tier's files: encrypted per namespace under keyed names, found again after a restart from the
index (files it does not know are deleted), bounded, and a bad file, a full disk or an unusable dir is a
miss or a logged degradation, never an exception."""

from __future__ import annotations

import errno
import logging
import os
import stat
import struct
from pathlib import Path

import pytest

from engine import kv_disk
from engine.kv_disk import DiskTier
from kv_cache.tiers import TierBlock

IDENTITY = b"model-a bf16 bs16 layout tier"
SECRET_TOKENS = [31337, 4242, 27182, 16180, 14142, 17320, 22360, 26457]


def payload(seed: int = 0, size: int = 4096) -> bytes:
    """A block's KV stand-in that holds the secret prompt's token ids in the clear, as int32 and as int64."""
    ids = struct.pack(f"<{len(SECRET_TOKENS)}i", *SECRET_TOKENS) + struct.pack(
        f"<{len(SECRET_TOKENS)}q", *SECRET_TOKENS
    )
    body = bytes((seed + i) % 251 for i in range(size - len(ids)))
    return ids + body


def block(
    h: bytes, ns=(("cache_salt", "salt-of-tenant-one"),), owner=("tenant", "tenant-number-one")
) -> TierBlock:
    return TierBlock(0, h, ns, owner)


def files(d: Path) -> list[Path]:
    return sorted((d / "blocks").iterdir())


def test_files_hold_no_plaintext_and_names_say_nothing(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, IDENTITY)
    h = b"\x01" * 32
    data = payload()
    tier.put(block(h), data, tier.epoch)
    tier.close()
    (f,) = files(tmp_path)
    assert f.name == tier.file_name(h) and h.hex() not in f.name
    everything = b"".join(p.read_bytes() for p in tmp_path.rglob("*") if p.is_file())
    for needle in (
        struct.pack(f"<{len(SECRET_TOKENS)}i", *SECRET_TOKENS),
        struct.pack(f"<{len(SECRET_TOKENS)}q", *SECRET_TOKENS),
        data[100:164],  # any stretch of the KV itself
        # Long needles only: a 2-byte one turns up by chance in a few KB of ciphertext (a flaky test).
        b"salt-of-tenant-one",
        b"tenant-number-one",
    ):
        assert needle not in everything
    assert tier.get(block(h)) == data
    for secret in ("seed", "secret"):
        assert stat.S_IMODE((tmp_path / secret).stat().st_mode) == 0o600


def test_another_namespace_key_or_identity_cannot_read_a_block(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, IDENTITY)
    h = b"\x02" * 32
    tier.put(block(h), payload(), tier.epoch)
    assert tier.get(block(h, ns=(("cache_salt", "s2"),))) is None  # another tenant's key: a miss
    tier.put(block(h), payload(), tier.epoch)
    tier.close()
    other = DiskTier(tmp_path, 1 << 20, b"another model")
    assert other.none_hash != tier.none_hash  # another identity hashes every block differently
    assert other.get(block(h)) is None  # and even the same name fails authentication


def test_a_restart_finds_the_blocks_by_the_index_and_deletes_unknown_files(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, IDENTITY)
    hashes = [bytes([i]) * 32 for i in range(5)]
    for i, h in enumerate(hashes):
        tier.put(block(h), payload(i), tier.epoch)
    tier.close()
    (tmp_path / "blocks" / ("ab" * 32)).write_bytes(b"written after the last index save")
    again = DiskTier(tmp_path, 1 << 20, IDENTITY)
    assert again.none_hash == tier.none_hash  # the seed persists with the dir
    assert [again.get(block(h)) for h in hashes] == [payload(i) for i in range(5)]
    assert len(files(tmp_path)) == 5  # the unknown file is gone: no reset could have reached it


@pytest.mark.parametrize("damage", ["truncate", "flip", "swap"])
def test_a_damaged_file_is_a_miss_and_a_warning(tmp_path: Path, damage: str, caplog) -> None:
    tier = DiskTier(tmp_path, 1 << 20, IDENTITY)
    a, b = b"\x0a" * 32, b"\x0b" * 32
    tier.put(block(a), payload(1), tier.epoch)
    tier.put(block(b), payload(2), tier.epoch)
    fa, fb = tmp_path / "blocks" / tier.file_name(a), tmp_path / "blocks" / tier.file_name(b)
    raw = fa.read_bytes()
    if damage == "truncate":
        fa.write_bytes(raw[: len(raw) // 2])
    elif damage == "flip":
        fa.write_bytes(raw[:-100] + bytes([raw[-100] ^ 1]) + raw[-99:])
    else:
        fa.write_bytes(fb.read_bytes())  # a valid file under another block's name
    with caplog.at_level(logging.WARNING):
        assert tier.get(block(a)) is None
    assert "unusable" in caplog.text
    assert not tier.contains(a) and not fa.exists()
    assert tier.get(block(b)) == payload(2)


def test_reset_by_owner_deletes_only_its_files_and_clear_deletes_all(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, 1 << 20, IDENTITY)
    tier.put(block(b"\x01" * 32, owner=("tenant", "t1")), payload(1), tier.epoch)
    tier.put(block(b"\x02" * 32, owner=("tenant", "t2")), payload(2), tier.epoch)
    tier.put(block(b"\x03" * 32, ns=(), owner=None), payload(3), tier.epoch)
    stale = tier.epoch
    assert tier.forget(("tenant", "t1")) == 1
    tier.put(block(b"\x04" * 32, owner=("tenant", "t1")), payload(4), stale)  # queued before the reset
    assert not tier.contains(b"\x01" * 32) and not tier.contains(b"\x04" * 32)
    assert len(files(tmp_path)) == 2
    tier.close()
    again = DiskTier(tmp_path, 1 << 20, IDENTITY)  # the owner tags survive the restart
    assert again.forget(("tenant", "t2")) == 1
    again.clear()
    assert files(tmp_path) == []


def test_the_dir_stays_under_its_size_least_recently_used_first(tmp_path: Path) -> None:
    one = len(kv_disk.MAGIC) + 12 + 4096 + 16
    tier = DiskTier(tmp_path, 3 * one, IDENTITY)
    hs = [bytes([i]) * 32 for i in range(4)]
    for h in hs[:3]:
        tier.put(block(h), payload(), tier.epoch)
    assert tier.get(block(hs[0])) is not None  # used: the second is now the oldest
    tier.put(block(hs[3]), payload(), tier.epoch)
    assert [tier.contains(h) for h in hs] == [True, False, True, True]
    assert sum(f.stat().st_size for f in files(tmp_path)) <= 3 * one


def test_a_full_disk_turns_the_tier_off_with_a_warning(tmp_path: Path, monkeypatch, caplog) -> None:
    tier = DiskTier(tmp_path, 1 << 20, IDENTITY)
    tier.put(block(b"\x01" * 32), payload(), tier.epoch)

    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(kv_disk.os, "replace", full)
    with caplog.at_level(logging.WARNING):
        tier.put(block(b"\x02" * 32), payload(), tier.epoch)  # no exception
    assert "turned off" in caplog.text and not tier.enabled
    assert not tier.contains(b"\x01" * 32)  # lookups miss from now on
    assert not any(p.name.startswith(".tmp") for p in files(tmp_path))


def test_an_unusable_dir_raises_for_the_caller_to_degrade(tmp_path: Path) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    with pytest.raises(OSError):
        DiskTier(not_a_dir / "kv", 1 << 20, IDENTITY)


def test_a_key_file_is_used_and_a_short_one_refused(tmp_path: Path) -> None:
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32))
    key.chmod(0o600)
    d = tmp_path / "kv"
    tier = DiskTier(d, 1 << 20, IDENTITY, key_file=key)
    tier.put(block(b"\x01" * 32), payload(), tier.epoch)
    tier.close()
    assert not (d / "secret").exists()
    key2 = tmp_path / "key2"
    key2.write_bytes(os.urandom(32))
    assert DiskTier(d, 1 << 20, IDENTITY, key_file=key2).get(block(b"\x01" * 32)) is None  # a copied dir
    key2.write_bytes(b"short")
    with pytest.raises(ValueError, match="at least 32"):
        DiskTier(d, 1 << 20, IDENTITY, key_file=key2)


def test_the_seed_and_secret_are_never_logged(tmp_path: Path, caplog) -> None:
    with caplog.at_level(logging.DEBUG):
        tier = DiskTier(tmp_path, 1 << 20, IDENTITY)
        tier.put(block(b"\x01" * 32), payload(), tier.epoch)
        tier.close()
    for name in ("seed", "secret"):
        value = (tmp_path / name).read_bytes()
        assert value.hex() not in caplog.text and repr(value) not in caplog.text
