"""KV tiers with the real default model (slow): a prefix evicted from the pool is loaded from the host tier or
the disk tier instead of recomputed, with exactly the tokens and logprobs recomputing gives; the disk tier
survives a restart for the same model, salt and dtype only; its files hold no prompt token ids or KV in the
clear; a tenant's reset deletes its files; a disk that fails turns the tier off, never a request."""

from __future__ import annotations

import asyncio
import errno
import os
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from engine import kv_disk, kv_tiers
from engine.async_engine import AsyncEngine
from engine.config import EngineConfig
from engine.kv_disk import DiskTier
from engine.model.device import resolve_dtype
from engine.request import Origin
from engine.sampling_params import SamplingParams
from kv_cache.namespace import CacheNamespace
from metrics.stats import IterationStats, SchedulerStats, StatLogger

pytestmark = pytest.mark.slow

NUM_BLOCKS = 40  # 640 tokens: a 320-token document plus a flood of others evicts it
PARAMS = SamplingParams(max_tokens=8, temperature=0.0, logprobs=3)
DOC = [(7 * i + 1000) % 30000 + 200 for i in range(320)]  # a "secret" prompt: its ids must never hit the disk
SALT = CacheNamespace(salt="salt-a")


class TierHits(StatLogger):
    """A stat logger summing the prefix-cache hits by tier."""

    def __init__(self) -> None:
        self.by_tier: dict[str, int] = {}

    def record(self, s: SchedulerStats, it: IterationStats) -> None:
        for tier, n in s.prefix_cache.tier_hits.items():
            self.by_tier[tier] = self.by_tier.get(tier, 0) + n


def make(hits: TierHits | None = None, device: str = "cpu", **kw: object) -> AsyncEngine:
    config = EngineConfig(
        num_blocks=NUM_BLOCKS,
        device=device,
        stat_loggers=[hits] if hits else [],
        **kw,  # type: ignore[arg-type]
    )
    return AsyncEngine.from_config(config)


async def run(engine: AsyncEngine, ids: list[int], ns: CacheNamespace | None = SALT):
    tokens, logprobs, cached = [], [], 0
    async for out in engine.generate(ids, PARAMS, origin=Origin(ns)):
        for c in out.outputs:
            tokens += c.token_ids
            logprobs += [(lp.token_id, lp.logprob, lp.top) for lp in c.logprobs or []]
        cached = out.num_cached_tokens
    return tokens, logprobs, cached


async def flood(engine: AsyncEngine) -> None:
    for k in range(3):
        await run(engine, [(k * 331 + i * 13) % 29000 + 300 for i in range(300)])


async def settle(engine: AsyncEngine) -> None:
    """Writes pin blocks until their KV is copied out: wait for every block to be back."""
    for _ in range(500):
        if engine.num_used_blocks() == 0:
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"{engine.num_used_blocks()} blocks still in use")


def dir_bytes(d: Path) -> bytes:
    return b"".join(p.read_bytes() for p in d.rglob("*") if p.is_file())


def block_files(d: Path) -> int:
    return len(list((d / "blocks").iterdir()))


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
async def test_host_tier_serves_an_evicted_prefix_with_the_same_tokens_and_logprobs(device: str) -> None:
    """On CUDA the host tier is the RAM between the device pool and the disk (copies on a stream of their own)."""
    hits = TierHits()
    engine = make(hits, device, kv_host_memory=64 * 2**20)
    try:
        cold = await run(engine, DOC)
        await flood(engine)
        warm = await run(engine, DOC)
        assert warm[2] >= 304 and hits.by_tier.get("host", 0) >= 304
        assert warm[:2] == cold[:2]  # same tokens, same logprobs, bit for bit
        await settle(engine)
        engine._core.kv_manager.check_invariants()
    finally:
        engine.shutdown()


async def test_disk_tier_survives_a_restart_for_the_same_setup_only(tmp_path: Path, monkeypatch) -> None:
    d = tmp_path / "kv"
    first = make(kv_disk_dir=str(d))
    try:
        cold = await run(first, DOC)
        tenant = CacheNamespace(tenant="t1")
        await run(first, DOC[:200], tenant)
        await settle(first)
    finally:
        first.shutdown()
    raw = dir_bytes(d)
    for fmt in ("<{}i", "<{}q"):  # the prompt's ids, as int32 and int64, in no file (nor any 16 of them)
        for start in (0, 100, 300):
            assert struct.pack(fmt.format(16), *DOC[start : start + 16]) not in raw

    hits = TierHits()
    again = make(hits, kv_disk_dir=str(d))
    try:
        warm = await run(again, DOC)
        assert warm[2] >= 304 and hits.by_tier.get("disk", 0) >= 304
        assert warm[:2] == cold[:2]
        assert (await run(again, DOC, CacheNamespace(salt="salt-b")))[2] == 0  # another salt: nothing
        before = block_files(d)
        await settle(again)
        again.forget_prefix_cache(("tenant", "t1"))  # a tenant's reset reaches its files
        assert block_files(d) == before - 200 // 16
        assert (await run(again, DOC[:200], tenant))[2] < 16  # its blocks are gone from the disk too
        await settle(again)
    finally:
        again.shutdown()

    # Another dtype than "auto" resolved to on this CPU (bfloat16 on AVX512-BF16, float32 on AVX2).
    other = "bfloat16" if resolve_dtype("auto", torch.device("cpu")) == torch.float32 else "float32"
    other_dtype = make(kv_disk_dir=str(d), dtype=other)
    try:
        assert (await run(other_dtype, DOC))[2] == 0
        await settle(other_dtype)
    finally:
        other_dtype.shutdown()

    monkeypatch.setattr(kv_tiers, "weights_fingerprint", lambda *a: "other weights")
    other_model = make(kv_disk_dir=str(d))
    try:
        assert (await run(other_model, DOC))[2] == 0
        await settle(other_model)
    finally:
        other_model.shutdown()


async def test_a_failing_disk_turns_the_tier_off_and_requests_go_on(tmp_path: Path, monkeypatch) -> None:
    def full(*a, **k):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    engine = make(kv_disk_dir=str(tmp_path / "kv"))
    try:
        monkeypatch.setattr(kv_disk.os, "replace", full)
        first = await run(engine, DOC)
        deadline = time.monotonic() + 10
        disk = engine._core.tiers.tiers[-1]  # type: ignore[union-attr]
        while disk.enabled and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert not disk.enabled
        await flood(engine)
        assert (await run(engine, DOC))[:2] == first[:2]
        await settle(engine)
    finally:
        engine.shutdown()

    # An unusable dir at startup: a warning and no disk tier, the server still serves.
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("x")
    engine = make(kv_disk_dir=str(not_a_dir / "kv"))
    try:
        assert engine._core.tiers is None
        assert (await run(engine, DOC))[0]
    finally:
        engine.shutdown()


async def test_tier_work_pending_until_every_block_of_a_prompt_is_on_disk(
    tmp_path: Path, monkeypatch
) -> None:
    plain = make()
    try:
        await run(plain, DOC[:40])
        assert not plain.tier_work_pending()  # no tiers: never anything pending
    finally:
        plain.shutdown()
    put, disk_free = DiskTier.put, threading.Event()

    def held_put(self, *a, **k):  # a disk that takes its time: nothing is stored until the test says so
        disk_free.wait(60)
        return put(self, *a, **k)

    monkeypatch.setattr(DiskTier, "put", held_put)
    d = tmp_path / "kv"
    engine = make(kv_disk_dir=str(d))
    try:
        await run(engine, DOC)
        assert engine.tier_work_pending()  # the answer is out, its blocks are still being written
        assert block_files(d) == 0
        disk_free.set()
        for _ in range(500):
            if not engine.tier_work_pending():
                break
            await asyncio.sleep(0.01)
        assert not engine.tier_work_pending()
        # 320 prompt tokens and 8 more make 20 full blocks of 16: all written once nothing is pending
        assert block_files(d) >= len(DOC) // 16
        await settle(engine)
    finally:
        engine.shutdown()
