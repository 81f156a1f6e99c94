"""KVStore: tensor layout, sizing from a budget, and write_slots (write by slot)."""

from __future__ import annotations

import logging

import pytest
import torch

from engine.kv_store import KVStore, write_slots


def test_layout_and_zero_init() -> None:
    store = KVStore(3, 5, 4, 2, 8, torch.float16, "cpu")
    assert len(store.k_caches) == len(store.v_caches) == 3
    for t in (*store.k_caches, *store.v_caches):
        assert t.shape == (5, 4, 2, 8) and t.dtype == torch.float16 and t.device.type == "cpu"
        assert not t.any()
    assert store.k_caches[0].data_ptr() != store.v_caches[0].data_ptr()
    assert store.bytes_per_block == 2 * 3 * 4 * 2 * 8 * 2
    with pytest.raises(ValueError):
        KVStore(1, 0, 4, 2, 8, torch.float16, "cpu")


def test_blocks_from_budget() -> None:
    per_block = 2 * 2 * 16 * 4 * 8 * 2  # K+V, layers, block_size, heads, head_dim, fp16 bytes = 4096
    assert (
        KVStore.from_budget(100_000, 2, 16, 4, 8, torch.float16, "cpu").num_blocks
        == 100_000 // per_block
        == 24
    )
    assert KVStore.from_budget(per_block, 2, 16, 4, 8, torch.float16, "cpu").num_blocks == 1
    assert KVStore.from_budget(per_block * 7, 2, 16, 4, 8, torch.float32, "cpu").num_blocks == 3
    with pytest.raises(ValueError, match="below one block"):
        KVStore.from_budget(per_block - 1, 2, 16, 4, 8, torch.float16, "cpu")
    with pytest.raises(ValueError, match=">= 0 bytes"):
        KVStore.from_budget(-1, 2, 16, 4, 8, torch.float16, "cpu")


def test_from_budget_logs_blocks_and_tokens(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger="engine.kv_store"):
        store = KVStore.from_budget(64 * 2**10, 2, 16, 4, 8, torch.float16, "cpu")
    assert store.num_blocks == 16
    assert "16 blocks x 16 tokens = 256 tokens" in caplog.text
    with pytest.raises(ValueError, match="below one block"):
        KVStore.from_budget(100, 2, 16, 4, 8, torch.float16, "cpu")


@pytest.mark.parametrize("cache_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("slot_dtype", [torch.int64, torch.int32])
def test_write_by_slot(cache_dtype: torch.dtype, slot_dtype: torch.dtype) -> None:
    bs, heads, dim = 4, 2, 3
    store = KVStore(2, 6, bs, heads, dim, cache_dtype, "cpu")
    gen = torch.Generator().manual_seed(0)
    # Two requests' tokens in one batch: blocks [5, 1] (6 tokens) and block [3] (offset 2..3).
    pairs = [(5, 0), (5, 1), (5, 2), (5, 3), (1, 0), (1, 1), (3, 2), (3, 3)]
    slots = torch.tensor([b * bs + o for b, o in pairs], dtype=slot_dtype)
    k = torch.randn(len(pairs), heads, dim, generator=gen)
    v = torch.randn(len(pairs), heads, dim, generator=gen)
    write_slots(store.k_caches[1], store.v_caches[1], k, v, slots)
    expect_k = torch.zeros(6, bs, heads, dim, dtype=cache_dtype)
    expect_v = torch.zeros(6, bs, heads, dim, dtype=cache_dtype)
    for i, (b, o) in enumerate(pairs):
        expect_k[b, o] = k[i].to(cache_dtype)
        expect_v[b, o] = v[i].to(cache_dtype)
    assert torch.equal(store.k_caches[1], expect_k) and torch.equal(store.v_caches[1], expect_v)
    assert not store.k_caches[0].any() and not store.v_caches[0].any()  # other layers untouched


@pytest.mark.cuda
def test_write_on_cuda() -> None:
    store = KVStore(1, 4, 4, 2, 8, torch.bfloat16, "cuda")
    k = torch.randn(3, 2, 8, device="cuda", dtype=torch.bfloat16)
    write_slots(store.k_caches[0], store.v_caches[0], k, -k, torch.tensor([15, 0, 6], device="cuda"))
    assert torch.equal(store.k_caches[0][3, 3], k[0]) and torch.equal(store.v_caches[0][1, 2], -k[2])


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.cuda)])
def test_copy_blocks_reads_every_source_before_writing_any_destination(device: str) -> None:
    store = KVStore(2, 5, 4, 2, 3, torch.bfloat16, device)
    gen = torch.Generator().manual_seed(1)
    for t in (*store.k_caches, *store.v_caches):
        t.copy_(torch.randn(t.shape, generator=gen))
    before = [t.clone() for t in (*store.k_caches, *store.v_caches)]
    store.copy_blocks([(0, 1), (1, 2), (4, 4)])  # block 1 is a destination and a source; 4 onto itself
    for old, new in zip(before, (*store.k_caches, *store.v_caches), strict=True):
        assert torch.equal(new[1], old[0]) and torch.equal(new[2], old[1])  # old[1], not the copy of 0
        assert torch.equal(new[0], old[0]) and torch.equal(new[3], old[3]) and torch.equal(new[4], old[4])
    after = [t.clone() for t in (*store.k_caches, *store.v_caches)]
    store.copy_blocks([])  # nothing to copy: nothing changes
    assert all(torch.equal(a, b) for a, b in zip((*store.k_caches, *store.v_caches), after, strict=True))
