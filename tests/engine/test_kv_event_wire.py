"""The KV event encoder against vLLM's wire schema, field by field, through a msgpack round trip."""

from __future__ import annotations

import msgpack
import pytest

from engine.kv_event_wire import END_SEQ, MEDIUM, encode_batch, event_to_wire, seq_bytes
from kv_cache.manager import KVCacheManager
from kv_cache.namespace import CacheNamespace
from kv_cache.stats import AllBlocksCleared, BlockRemoved, BlockStored
from tests.kv_cache.kv_fakes import FakeRequest, admit, release

H1, H2, H3 = b"\x01" * 32, b"\x02" * 32, b"\x03" * 32


def _decode(payload: bytes) -> list:
    return msgpack.unpackb(payload, raw=False)


def test_batch_is_vllm_array_ts_events_rank() -> None:
    batch = _decode(encode_batch([AllBlocksCleared()], ts=12.5, data_parallel_rank=3))
    assert isinstance(batch, list) and len(batch) == 3
    ts, events, rank = batch
    assert ts == 12.5 and isinstance(ts, float)
    assert events == [{"type": "AllBlocksCleared"}]
    assert rank == 3


def test_block_stored_fields() -> None:
    ev = BlockStored([H2, H3], H1, list(range(8)), 4)
    (wire,) = _decode(encode_batch([ev], ts=1.0))[1]
    assert wire == {
        "type": "BlockStored",
        "block_hashes": [H2, H3],
        "parent_block_hash": H1,
        "token_ids": list(range(8)),
        "block_size": 4,
        "lora_id": None,
        "medium": MEDIUM,
        "lora_name": None,
        "group_idx": 0,
        "kv_cache_spec_kind": "full",
    }
    # Hashes travel as msgpack bin (vLLM's bytes), not str: a router keys them as opaque bytes.
    assert all(isinstance(h, bytes) for h in wire["block_hashes"])
    assert "extra_keys" not in wire  # vLLM's field that would carry a salt: never sent


def test_block_stored_root_has_nil_parent() -> None:
    (wire,) = _decode(encode_batch([BlockStored([H1], None, [5, 6, 7, 8], 4)], ts=1.0))[1]
    assert wire["parent_block_hash"] is None
    assert len(wire["token_ids"]) == wire["block_size"] * len(wire["block_hashes"])


def test_block_removed_fields() -> None:
    (wire,) = _decode(encode_batch([BlockRemoved([H1, H2])], ts=1.0))[1]
    assert wire == {"type": "BlockRemoved", "block_hashes": [H1, H2], "medium": MEDIUM, "group_idx": 0}


def test_events_keep_their_order_in_a_batch() -> None:
    events = [BlockStored([H1], None, [1, 2], 2), BlockRemoved([H1]), AllBlocksCleared()]
    types = [e["type"] for e in _decode(encode_batch(events, ts=0.0))[1]]
    assert types == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]


def test_not_an_event_is_refused() -> None:
    with pytest.raises(TypeError):
        event_to_wire("BlockStored")  # type: ignore[arg-type]


def test_sequence_numbers_are_8_byte_big_endian_and_end_marker_is_minus_one() -> None:
    assert seq_bytes(0) == b"\x00" * 8
    assert seq_bytes(258) == b"\x00" * 6 + b"\x01\x02"
    assert int.from_bytes(END_SEQ, "big", signed=True) == -1


def test_salted_tenant_events_on_the_wire_carry_no_salt_or_tenant() -> None:
    """Real events of a salted tenant's request, encoded: no byte of the payload names the salt or tenant."""
    mgr = KVCacheManager(16, 4, enable_events=True)
    prompt = list(range(100, 110))
    ns = CacheNamespace(tenant="tenant-zz9", salt="salt-qq7")
    req = FakeRequest("r", prompt, mgr.make_hasher(ns, prompt))
    admit(mgr, req)
    payload = encode_batch(mgr.take_events(), ts=0.0)
    assert b"tenant-zz9" not in payload and b"salt-qq7" not in payload
    (stored,) = _decode(payload)[1]
    assert stored["token_ids"] == prompt[:8] and stored["block_hashes"] == req.block_hashes[:2]
    release(mgr, req)
