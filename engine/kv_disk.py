"""The disk tier (`--kv-disk-dir`, `--kv-disk-size`): KV blocks in files that survive restarts and keep
tenants apart.

The directory holds:
- `seed` (32 random bytes, 0600): the block-hash seed. Block 0's parent hash is HMAC(seed, identity), so the
  hashes are the same across restarts of the same model (hits), differ for anything else (misses), and
  cannot be guessed without the seed. Never logged.
- `secret` (32 random bytes, 0600), unless `--kv-disk-key-file` names one elsewhere: the root of every key.
- `blocks/<name>`: one file per block, `MAGIC | nonce | AES-256-GCM(payload)`. `name` is HMAC(name key, block
  hash) in hex, so a listing says nothing of the blocks; the encryption key is derived (HKDF) from the secret
  and the block's namespace (the public namespace for public-prefix blocks), so one tenant's key opens no
  other tenant's block; the associated data binds the file to its name and the model identity, so a file
  moved under another name, or read by another model, fails authentication (a miss, never other KV).
- `index`: the LRU order, sizes and owner tags (HMAC of the owner) of the blocks, encrypted too. Startup reads
  it and lists `blocks/` (no file is opened): files it does not know (written after its last save, before a
  crash) are deleted, since a tenant's reset could not find them otherwise.

Degradation: an unusable dir at startup or a failed write (disk full, read-only) turns the tier off with one
warning; requests never fail for it. A file that is missing, truncated, tampered with or unreadable is a miss,
a warning and a deleted file.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import threading
import time
from collections import OrderedDict
from pathlib import Path

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

from kv_cache.hashing import BlockHash, encode
from kv_cache.namespace import Owner
from kv_cache.tiers import NamespaceKeys, TierBlock, TierEntry, TierIndex

logger = logging.getLogger(__name__)

MAGIC = b"BKV1"
_NONCE = 12
_INDEX_SAVE_EVERY = 64  # puts between index saves (and at close): a crash loses at most these blocks
_INDEX_SAVE_SECONDS = 5.0


def read_or_create_secret(path: Path, *, create: bool) -> bytes:
    """32+ secret bytes from `path`; when absent and `create`, 32 random bytes written there with mode 0600
    (O_EXCL: two servers starting at once agree on one). The bytes are never logged."""
    try:
        data = path.read_bytes()
    except FileNotFoundError:
        if not create:
            raise
        data = os.urandom(32)
        try:
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        except FileExistsError:
            return read_or_create_secret(path, create=False)
        with os.fdopen(fd, "wb") as f:
            f.write(data)
        return data
    if len(data) < 32:
        raise ValueError(f"{path} holds {len(data)} bytes; a KV disk secret needs at least 32")
    if path.stat().st_mode & 0o077:
        logger.warning(
            "%s is readable by other users: anyone who reads it can decrypt the KV disk tier", path
        )
    return data


def _hkdf(secret: bytes, info: bytes) -> bytes:
    return HKDF(algorithm=hashes.SHA256(), length=32, salt=None, info=info).derive(secret)


class DiskTier:
    """KV blocks as encrypted files in `directory`, at most `capacity` bytes of them (TierStore)."""

    name = "disk"

    def __init__(
        self, directory: Path, capacity: int, identity: bytes, *, key_file: Path | None = None
    ) -> None:
        """`identity`: the digest of everything that makes two servers' KV the same bits (engine.kv_tiers).
        Raises OSError / ValueError when the directory or the secret is unusable (the caller degrades)."""
        self.directory = directory
        self.blocks_dir = directory / "blocks"
        self.blocks_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
        self.seed = read_or_create_secret(directory / "seed", create=True)
        secret = (
            read_or_create_secret(key_file, create=False)
            if key_file is not None
            else read_or_create_secret(directory / "secret", create=True)
        )
        self.identity = identity
        self.none_hash = hmac.new(self.seed, b"brine-none-hash" + identity, hashlib.sha256).digest()
        self._secret = secret
        self._name_key = _hkdf(secret, b"brine-kv-name")
        self._index_aead = AESGCM(_hkdf(secret, b"brine-kv-index"))
        self._aeads: OrderedDict[NamespaceKeys, AESGCM] = OrderedDict()  # a bounded cache of derived keys
        self.index: TierIndex[str] = TierIndex(capacity)
        self._lock = threading.Lock()
        self.epoch = 0
        self._enabled = capacity > 0
        self._puts_since_save = 0
        self._saved_at = time.monotonic()
        self.num_corrupt = 0
        self.num_write_errors = 0
        self._load_index()

    # ---- names and keys --------------------------------------------------------------------------------

    def file_name(self, block_hash: BlockHash) -> str:
        return hmac.new(self._name_key, block_hash, hashlib.sha256).hexdigest()

    def _owner_tag(self, owner: Owner | None) -> Owner | None:
        if owner is None:
            return None
        return ("disk", hmac.new(self._name_key, b"owner" + encode(owner), hashlib.sha256).hexdigest())

    def _aead(self, namespace: NamespaceKeys) -> AESGCM:
        aead = self._aeads.get(namespace)
        if aead is None:
            aead = AESGCM(_hkdf(self._secret, b"brine-kv-block" + encode(namespace)))
            self._aeads[namespace] = aead
            if len(self._aeads) > 4096:
                self._aeads.popitem(last=False)
        return aead

    # ---- TierStore -------------------------------------------------------------------------------------

    @property
    def enabled(self) -> bool:
        return self._enabled

    @property
    def num_blocks(self) -> int:
        return len(self.index)

    @property
    def num_bytes(self) -> int:
        return self.index.total_bytes

    def contains(self, block_hash: BlockHash) -> bool:
        return self._enabled and self.file_name(block_hash) in self.index

    def get(self, block: TierBlock) -> bytes | None:
        name = self.file_name(block.block_hash)
        with self._lock:
            if not self._enabled or name not in self.index:
                return None
            self.index.touch(name)
        path = self.blocks_dir / name
        try:
            data = path.read_bytes()
            if len(data) < len(MAGIC) + _NONCE + 16 or not data.startswith(MAGIC):
                raise ValueError("truncated or not a KV block file")
            nonce = data[len(MAGIC) : len(MAGIC) + _NONCE]
            return self._aead(block.namespace).decrypt(nonce, data[len(MAGIC) + _NONCE :], self._ad(name))
        except (OSError, ValueError, InvalidTag) as exc:
            # Never the file's contents or the namespace in the message: only that the file was unusable.
            logger.warning(
                "KV disk tier: a block file is unusable (%s); dropped, recomputing", type(exc).__name__
            )
            self.num_corrupt += 1
            self._drop(name)
            return None

    def put(self, block: TierBlock, payload: bytes, epoch: int) -> None:
        if not self._enabled:
            return
        name = self.file_name(block.block_hash)
        if name in self.index:
            return
        nonce = os.urandom(_NONCE)
        data = MAGIC + nonce + self._aead(block.namespace).encrypt(nonce, payload, self._ad(name))
        path = self.blocks_dir / name
        tmp = self.blocks_dir / f".tmp-{name}"
        try:
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except OSError as exc:
            self._unlink(tmp)
            self._disable(f"a write failed ({exc.strerror or type(exc).__name__})")
            return
        with self._lock:
            if epoch != self.epoch or not self._enabled:
                evicted = [name]  # a reset came after this write was queued: it must not bring it back
            else:
                entry = TierEntry(len(data), self._owner_tag(block.owner), block.retain_until)
                evicted = self.index.add(name, entry, time.time())
                self._puts_since_save += 1
        for key in evicted:
            self._unlink(self.blocks_dir / key)
        self._maybe_save_index()

    def forget(self, owner: Owner) -> int:
        tag = self._owner_tag(owner)
        assert tag is not None
        with self._lock:
            self.epoch += 1
            names = self.index.forget(tag)
        for name in names:
            self._unlink(self.blocks_dir / name)
        if names:
            self.save_index()
        return len(names)

    def clear(self) -> None:
        with self._lock:
            self.epoch += 1
            names = self.index.clear()
        for name in names:
            self._unlink(self.blocks_dir / name)
        self.save_index()

    def close(self) -> None:
        if self._enabled:
            self.save_index()

    # ---- internals -------------------------------------------------------------------------------------

    def _ad(self, name: str) -> bytes:
        return MAGIC + name.encode() + self.identity

    def _drop(self, name: str) -> None:
        with self._lock:
            self.index.remove(name)
        self._unlink(self.blocks_dir / name)

    def _unlink(self, path: Path) -> None:
        try:
            path.unlink(missing_ok=True)
        except OSError:
            pass

    def _disable(self, why: str) -> None:
        self.num_write_errors += 1
        if self._enabled:
            self._enabled = False
            logger.warning("KV disk tier turned off: %s; requests go on without it", why)

    def _maybe_save_index(self) -> None:
        if (
            self._puts_since_save >= _INDEX_SAVE_EVERY
            or time.monotonic() - self._saved_at > _INDEX_SAVE_SECONDS
        ):
            self.save_index()

    def save_index(self) -> None:
        """Write the index (atomically: a temporary file, then a rename)."""
        with self._lock:
            entries = [
                [k, e.size, e.owner[1] if e.owner else None, e.retain_until]
                for k, e in self.index.entries.items()
            ]
            self._puts_since_save = 0
            self._saved_at = time.monotonic()
        nonce = os.urandom(_NONCE)
        body = self._index_aead.encrypt(nonce, json.dumps(entries).encode(), MAGIC + b"index")
        tmp = self.directory / ".index.tmp"
        try:
            with open(tmp, "wb") as f:
                f.write(MAGIC + nonce + body)
            os.replace(tmp, self.directory / "index")
        except OSError as exc:
            self._disable(f"the index could not be saved ({exc.strerror or type(exc).__name__})")

    def _load_index(self) -> None:
        entries: list[list[object]] = []
        path = self.directory / "index"
        try:
            data = path.read_bytes()
            nonce = data[len(MAGIC) : len(MAGIC) + _NONCE]
            entries = json.loads(
                self._index_aead.decrypt(nonce, data[len(MAGIC) + _NONCE :], MAGIC + b"index")
            )
        except FileNotFoundError:
            pass
        except (OSError, ValueError, InvalidTag):
            logger.warning("KV disk tier: the index is unreadable (another key, or damaged); starting empty")
        present = {n for n in os.listdir(self.blocks_dir)}
        known: set[str] = set()
        for name, size, tag, retain in entries:
            if isinstance(name, str) and name in present and isinstance(size, int):
                owner = ("disk", tag) if isinstance(tag, str) else None
                ret = float(retain) if isinstance(retain, (int, float)) else 0.0
                for gone in self.index.add(name, TierEntry(size, owner, ret)):
                    self._unlink(self.blocks_dir / gone)
                known.add(name)
        for name in present - set(self.index.entries):
            self._unlink(self.blocks_dir / name)  # unknown owner (or evicted): a reset could never reach it
        if self._enabled and (present - known or len(known) != len(entries)):
            self.save_index()
