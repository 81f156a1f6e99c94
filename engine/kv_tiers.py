"""KVTiers: the copies between the device KV pages (`engine.kv_store.KVStore`) and the tiers behind the pool
(`kv_cache.tiers.HostTier`, `engine.kv_disk.DiskTier`), on two threads of their own so that the step thread
never waits for a tier.

- Writes (write-through): every block the pool caches is pinned by the manager (one more reference, so it
  cannot be reallocated), and after the step that computes it, handed here. The writer thread reads its KV
  out of the pages, tells the manager to unpin it (`poll`), then stores it in every tier (encryption and
  file writes happen after the unpin). Blocks some tier already holds are not written again. Measured
  against writing on eviction: eviction happens inside `BlockPool.take`, on the step thread, right before
  the step overwrites the block, so its copy would have to delay that step; write-through costs the step
  nothing and makes a block survive a crash as soon as it is written.
- Loads: a request whose lookup hits a tier gets fresh pool blocks (`KVCacheManager.start_load`) and waits
  outside the scheduler's queues; the loader thread reads the blocks (host tier first, then disk, which also
  warms the host tier), copies them into the pages and reports how many arrived (`poll`). Only that request
  waits: the blocks are its own until then, so the steps of others run beside the load.

Identity (`kv_identity`): the typed record of everything that makes KV bits reusable: the weight files'
contents (a fingerprint, not their path), dtype, block size, KV layout, kernel tier, attention backend and
linears, batch invariance. Its digest seeds the block hashes of a disk tier, so a block of any other setup is
never even found.
"""

from __future__ import annotations

import hashlib
import json
import logging
import queue
import threading
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine.kv_store import _SAME_BYTES, KVStore
from kv_cache.hashing import BlockHash, encode
from kv_cache.namespace import Owner
from kv_cache.tiers import HostTier, LoadPlan, TierBlock, TierStore

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class KVIdentity:
    """What two servers must share for one's KV blocks to be the bits the other would compute."""

    weights: str  # sha256 over the model directory's files (names and contents)
    dtype: str
    block_size: int
    layout: str  # the page layout and its dimensions
    device: str  # cpu | cuda:<name>
    kernel_tier: str  # the CPU kernels' tier (avx512-bf16, avx512, avx2, portable) or the CUDA build
    attention: str
    linears: str
    batch_invariant: bool
    hash_algo: str

    def digest(self) -> bytes:
        return hashlib.sha256(encode(tuple(f"{k}={v}" for k, v in asdict(self).items()))).digest()


def weights_fingerprint(model_dir: Path, cache_file: Path | None = None) -> str:
    """sha256 over every file of the model directory (relative names and contents). Cached in `cache_file`
    by (path, size, mtime, inode), so a restart does not reread gigabytes of unchanged weights."""
    files = sorted(p for p in model_dir.rglob("*") if p.is_file())
    stamp = [[str(p.resolve()), p.stat().st_size, p.stat().st_mtime_ns, p.stat().st_ino] for p in files]
    key = hashlib.sha256(json.dumps(stamp).encode()).hexdigest()
    cached: dict[str, str] = {}
    if cache_file is not None:
        try:
            cached = json.loads(cache_file.read_text())
        except (OSError, ValueError):
            cached = {}
        if isinstance(cached, dict) and isinstance(cached.get(key), str):
            return cached[key]
    h = hashlib.sha256()
    for p in files:
        h.update(encode(str(p.relative_to(model_dir))))
        file_hash = hashlib.sha256()
        with open(p, "rb") as f:
            while chunk := f.read(1 << 22):
                file_hash.update(chunk)
        h.update(file_hash.digest())
    digest = h.hexdigest()
    if cache_file is not None:
        try:
            cache_file.write_text(json.dumps({key: digest}))
        except OSError:
            pass
    return digest


def kv_identity(runner: Any, config: Any, model_dir: Path, cache_file: Path | None) -> KVIdentity:
    store: KVStore = runner.kv_store
    device = store.device
    if device.type == "cuda":
        kernel = f"cuda {torch.version.cuda} {torch.cuda.get_device_name(device)} torch {torch.__version__}"
        dev = f"cuda:{torch.cuda.get_device_name(device)}"
    else:
        from engine.model.kernels.build import load

        kernels, why = load()
        kernel = kernels.tier if kernels is not None else f"none ({why})"
        dev = "cpu"
    return KVIdentity(
        weights=weights_fingerprint(model_dir, cache_file),
        dtype=str(store.dtype),
        block_size=store.block_size,
        layout=f"kv-pages-v1 [2*{store.num_layers}, block, {store.num_kv_heads}, {store.head_dim}]",
        device=dev,
        kernel_tier=kernel,
        attention=str(getattr(runner, "attention_backend", "")),
        linears=str(getattr(runner, "linear_weights", "")),
        batch_invariant=bool(getattr(runner, "batch_invariant", True)),
        hash_algo=config.prefix_caching_hash_algo,
    )


@dataclass(slots=True)
class _Write:
    blocks: list[TierBlock]
    epochs: dict[str, int]


class KVTiers:
    """The tiers behind one pool, host first (TierLookup for the manager), and their copy threads."""

    def __init__(
        self, store: KVStore, tiers: Sequence[TierStore], none_hash: BlockHash | None = None
    ) -> None:
        self.store = store
        self.tiers = list(tiers)
        self.none_hash = none_hash
        self._writes: queue.Queue[_Write | None] = queue.Queue()
        self._loads: queue.Queue[LoadPlan | None] = queue.Queue()
        self._lock = threading.Lock()
        self._done = threading.Event()
        self._loaded: list[tuple[str, int]] = []  # (request id, blocks that arrived), for poll()
        self._unpin: list[int] = []
        self._in_flight = 0  # writes and loads queued and not yet polled
        self._writing = 0  # write jobs whose blocks are not yet stored in every tier (after their unpin too)
        self.num_written = 0
        self.num_loaded: dict[str, int] = {t.name: 0 for t in self.tiers}
        self._stream = torch.cuda.Stream(store.device) if store.device.type == "cuda" else None
        self._threads = [
            threading.Thread(target=self._write_loop, name="brine-kv-writer", daemon=True),
            threading.Thread(target=self._load_loop, name="brine-kv-loader", daemon=True),
        ]
        for t in self._threads:
            t.start()

    # ---- TierLookup ------------------------------------------------------------------------------------

    def find(self, hashes: Sequence[BlockHash]) -> list[str]:
        out: list[str] = []
        for h in hashes:
            for tier in self.tiers:
                if tier.enabled and tier.contains(h):
                    out.append(tier.name)
                    break
            else:
                break
        return out

    def contains(self, block_hash: BlockHash) -> bool:
        return all(not t.enabled or t.contains(block_hash) for t in self.tiers)

    # ---- from the step thread --------------------------------------------------------------------------

    def submit_writes(self, blocks: list[TierBlock]) -> None:
        if blocks:
            with self._lock:
                self._in_flight += 1
                self._writing += 1
            self._writes.put(_Write(blocks, {t.name: t.epoch for t in self.tiers}))

    def submit_loads(self, plans: list[LoadPlan]) -> None:
        for plan in plans:
            with self._lock:
                self._in_flight += 1
            self._loads.put(plan)

    def poll(self) -> tuple[list[tuple[str, int]], list[int]]:
        """(loads finished: request id and how many leading blocks arrived, blocks to unpin) since the last."""
        with self._lock:
            loaded, self._loaded = self._loaded, []
            unpin, self._unpin = self._unpin, []
            self._done.clear()
        return loaded, unpin

    @property
    def busy(self) -> bool:
        with self._lock:
            return self._in_flight > 0

    @property
    def writing(self) -> bool:
        """Whether submitted blocks are still being encrypted or written (their pages may be free already)."""
        with self._lock:
            return self._writing > 0

    def wait(self, timeout: float) -> None:
        """Block until a write or load finishes, at most `timeout` seconds (an idle step thread's wait)."""
        self._done.wait(timeout)

    def forget(self, owner: Owner) -> int:
        return sum(t.forget(owner) for t in self.tiers)

    def clear(self) -> None:
        for t in self.tiers:
            t.clear()

    def close(self) -> None:
        self._writes.put(None)
        self._loads.put(None)
        for t in self._threads:
            t.join(timeout=30)
        for tier in self.tiers:
            tier.close()

    # ---- the copy threads ------------------------------------------------------------------------------

    def _finish(self, loaded: tuple[str, int] | None = None, unpin: list[int] | None = None) -> None:
        with self._lock:
            if loaded is not None:
                self._loaded.append(loaded)
            if unpin is not None:
                self._unpin += unpin
            self._in_flight -= 1
            self._done.set()

    def _write_loop(self) -> None:
        while (job := self._writes.get()) is not None:
            payloads: list[bytes] = []
            try:
                payloads = self._read_pages([b.block_id for b in job.blocks])
            except Exception:  # never the engine's death: the blocks just are not written
                logger.exception("KV tiers: reading blocks for a write failed")
            self._finish(unpin=[b.block_id for b in job.blocks])
            for block, payload in zip(job.blocks, payloads, strict=False):
                for tier in self.tiers:
                    if tier.enabled:
                        try:
                            tier.put(block, payload, job.epochs[tier.name])
                        except Exception:
                            logger.exception("KV tiers: a %s write failed", tier.name)
            self.num_written += len(payloads)
            with self._lock:
                self._writing -= 1

    def _load_loop(self) -> None:
        while (plan := self._loads.get()) is not None:
            n = 0
            try:
                n = self._load(plan)
            except Exception:
                logger.exception("KV tiers: a load failed; the request recomputes")
            self._finish(loaded=(plan.request_id, n))

    def _load(self, plan: LoadPlan) -> int:
        payloads: list[bytes] = []
        by_name = {t.name: t for t in self.tiers}
        size = self.store.bytes_per_block
        for block, name in zip(plan.blocks, plan.tiers, strict=True):
            if plan.abandoned:
                break
            data = by_name[name].get(block)
            if data is None and name != self.tiers[-1].name:
                data = self.tiers[-1].get(block)  # evicted from the host tier since the lookup
                name = self.tiers[-1].name
            if data is None or len(data) != size:
                break
            if name != self.tiers[0].name and self.tiers[0].enabled:
                self.tiers[0].put(block, data, self.tiers[0].epoch)  # warm the faster tier
            self.num_loaded[name] += 1
            payloads.append(data)
        if payloads:
            self._write_pages([b.block_id for b in plan.blocks[: len(payloads)]], payloads)
        return len(payloads)

    def _read_pages(self, ids: list[int]) -> list[bytes]:
        pages = self.store.pages
        if self._stream is None:
            arr = pages.view(_SAME_BYTES[pages.dtype.itemsize]).numpy()
            return [arr[:, b].tobytes() for b in ids]  # one C-order copy each, straight from the pages
        with torch.cuda.stream(self._stream):
            host = pages[:, ids].to("cpu", non_blocking=True)  # [2L, n, bs, H, D]
        self._stream.synchronize()
        flat = host.view(_SAME_BYTES[host.dtype.itemsize]).numpy()
        return [flat[:, i].tobytes() for i in range(len(ids))]

    def _write_pages(self, ids: list[int], payloads: list[bytes]) -> None:
        pages = self.store.pages
        shape = (pages.shape[0], *pages.shape[2:])
        np_dtype = _SAME_BYTES[pages.dtype.itemsize]
        if self._stream is None:
            arr = pages.view(np_dtype).numpy()
            for b, data in zip(ids, payloads, strict=True):
                arr[:, b] = np.frombuffer(data, dtype=arr.dtype).reshape(shape)
            return
        host = torch.stack(
            [
                torch.frombuffer(bytearray(d), dtype=np_dtype).view(pages.dtype).reshape(shape)
                for d in payloads
            ],
            1,
        ).pin_memory()
        with torch.cuda.stream(self._stream):
            pages[:, ids] = host.to(pages.device, non_blocking=True)
        self._stream.synchronize()


def build_tiers(config: Any, runner: Any) -> KVTiers | None:
    """The tiers `config` asks for (`kv_host_memory`, `kv_disk_dir`), or None. A disk dir that cannot be used
    is a warning and no disk tier, never a failed start."""
    host_bytes = getattr(config, "kv_host_memory", None) or 0
    disk_dir = getattr(config, "kv_disk_dir", None)
    if not host_bytes and not disk_dir:
        return None
    store: KVStore | None = getattr(runner, "kv_store", None)
    if not isinstance(store, KVStore):
        logger.warning("KV tiers need the runner's KV pages; running without them")
        return None
    tiers: list[TierStore] = []
    if host_bytes:
        tiers.append(HostTier(host_bytes))
    none_hash = None
    if disk_dir:
        from engine.kv_disk import DiskTier

        directory = Path(disk_dir)
        key_file = getattr(config, "kv_disk_key_file", None)
        try:
            directory.mkdir(parents=True, exist_ok=True, mode=0o700)
            identity = kv_identity(runner, config, Path(config.model), directory / "fingerprint.json")
            disk = DiskTier(
                directory,
                getattr(config, "kv_disk_size", None) or 10 * 2**30,
                identity.digest(),
                key_file=Path(key_file) if key_file else None,
            )
        except (OSError, ValueError) as exc:
            logger.warning("KV disk tier off: %s cannot be used (%s)", disk_dir, exc)
        else:
            tiers.append(disk)
            none_hash = disk.none_hash
            logger.info(
                "KV disk tier: %d blocks (%.1f MiB) found in %s, up to %.1f GiB",
                disk.num_blocks,
                disk.num_bytes / 2**20,
                disk_dir,
                disk.index.capacity / 2**30,
            )
    if not tiers:
        return None
    return KVTiers(store, tiers, none_hash)
