"""The ZMQ publisher: sequence numbering, framing, the replay socket, and the engine core feeding it."""

from __future__ import annotations

import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq
from engine_fakes import FakeRunner, make_core, run_to_completion

from engine.kv_event_publisher import KVEventPublisher, is_wildcard, replay_endpoint_for
from engine.kv_event_wire import END_SEQ
from engine.sampling_params import SamplingParams
from kv_cache.stats import AllBlocksCleared, BlockRemoved, BlockStored
from tests.e2e.e2e_server import free_port

TIMEOUT_MS = 5000


@pytest.fixture
def publisher() -> Iterator[KVEventPublisher]:
    port = free_port()
    pub = KVEventPublisher(f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{free_port()}", buffer_steps=3)
    yield pub
    pub.shutdown()


def _subscribe(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    sub.setsockopt(zmq.LINGER, 0)
    sub.connect(endpoint)
    time.sleep(0.3)  # PUB drops what it sends before a subscriber has joined (ZMQ's slow joiner)
    return sub


def _replay(ctx: zmq.Context, endpoint: str, start: int) -> list[tuple[int, bytes]]:
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, TIMEOUT_MS)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(endpoint)
    dealer.send_multipart([b"", start.to_bytes(8, "big")])
    got = []
    while True:
        empty, seq, payload = dealer.recv_multipart()
        assert empty == b""
        if seq == END_SEQ:
            assert payload == b""
            dealer.close()
            return got
        got.append((int.from_bytes(seq, "big", signed=True), payload))


def test_batches_are_numbered_from_zero_in_order(publisher: KVEventPublisher) -> None:
    ctx = zmq.Context()
    sub = _subscribe(ctx, publisher.endpoint)
    publisher.publish([BlockStored([b"a" * 32], None, [1, 2], 2)])
    publisher.publish([])  # an empty batch is not sent and takes no number
    publisher.publish([BlockRemoved([b"a" * 32])])
    publisher.publish([AllBlocksCleared()])
    frames = [sub.recv_multipart() for _ in range(3)]
    assert [f[0] for f in frames] == [b"", b"", b""]  # the topic frame (default: empty)
    assert [int.from_bytes(f[1], "big") for f in frames] == [0, 1, 2]
    kinds = [msgpack.unpackb(f[2])[1][0]["type"] for f in frames]
    assert kinds == ["BlockStored", "BlockRemoved", "AllBlocksCleared"]
    sub.close()
    ctx.term()


def test_replay_resends_from_the_asked_sequence_then_ends(publisher: KVEventPublisher) -> None:
    ctx = zmq.Context()
    sub = _subscribe(ctx, publisher.endpoint)
    for i in range(5):
        publisher.publish([BlockRemoved([bytes([i]) * 32])])
    live = [sub.recv_multipart() for _ in range(5)]
    assert publisher.replay_endpoint is not None
    replayed = _replay(ctx, publisher.replay_endpoint, 3)
    assert [seq for seq, _ in replayed] == [3, 4]
    assert [p for _, p in replayed] == [f[2] for f in live[3:]]  # the very payloads sent live
    # Only the last buffer_steps (3) batches are kept: asking from 0 gets 2, 3, 4.
    assert [seq for seq, _ in _replay(ctx, publisher.replay_endpoint, 0)] == [2, 3, 4]
    # Asking past the end gets just the end marker.
    assert _replay(ctx, publisher.replay_endpoint, 99) == []
    sub.close()
    ctx.term()


def test_source_entry_is_vllm_kv_events_config(publisher: KVEventPublisher) -> None:
    src = publisher.source()
    assert src["endpoint"] == publisher.endpoint
    assert src["replay_endpoint"] == publisher.replay_endpoint
    assert src["topic"] == "" and src["publisher"] == "zmq" and src["enable_kv_cache_events"] is True


def test_taken_port_fails_at_construction() -> None:
    port = free_port()
    first = KVEventPublisher(f"tcp://127.0.0.1:{port}")
    try:
        with pytest.raises(zmq.ZMQError):
            KVEventPublisher(f"tcp://127.0.0.1:{port}")
    finally:
        first.shutdown()


@pytest.mark.parametrize(
    ("endpoint", "replay"),
    [("tcp://127.0.0.1:5557", "tcp://127.0.0.1:5558"), ("tcp://*:7000", "tcp://*:7001")],
)
def test_replay_endpoint_is_port_plus_one(endpoint: str, replay: str) -> None:
    assert replay_endpoint_for(endpoint) == replay


@pytest.mark.parametrize("bad", ["ipc:///tmp/x", "tcp://host", "tcp://host:port", "127.0.0.1:5557"])
def test_bad_endpoint_is_refused(bad: str) -> None:
    with pytest.raises(ValueError):
        replay_endpoint_for(bad)


def test_engine_core_hands_each_steps_events_to_the_sink() -> None:
    """The core feeds the sink once per step that changed the cache, then a reset's AllBlocksCleared."""
    batches: list[list] = []
    core = make_core(FakeRunner(num_blocks=32), kv_event_sink=batches.append)
    prompt = list(range(1, 40))  # 39 tokens: 9 full blocks of 4
    core.add_request("a", prompt, SamplingParams(max_tokens=1))
    run_to_completion(core)
    stored = [e for batch in batches for e in batch if isinstance(e, BlockStored)]
    assert stored[0].parent_block_hash is None and stored[0].block_size == 4
    assert [t for e in stored for t in e.token_ids][:36] == prompt[:36]
    assert all(batch for batch in batches)  # no empty batch is handed over
    assert core.reset_prefix_cache()
    assert isinstance(batches[-1][-1], AllBlocksCleared)


def test_engine_core_without_sink_records_no_events() -> None:
    core = make_core()
    assert core.kv_event_sink is None and core.kv_manager.take_events() == []


class ManualPublisher(KVEventPublisher):
    """A publisher whose thread only waits to close the sockets: the test drives `_turn` itself, one turn at
    a time, so what one turn does is observed exactly (the sockets are used by one thread at a time)."""

    def _run(self) -> None:
        self._stopping.wait()
        self._close_sockets()


def _removed(i: int) -> list:
    return [BlockRemoved([bytes([i]) * 32])]


def test_a_full_queue_drops_the_oldest_batch_and_never_blocks_the_engine() -> None:
    pub = ManualPublisher(f"tcp://127.0.0.1:{free_port()}", max_queued_batches=4)
    try:
        for i in range(10):  # nothing drains the queue: an unbounded one would hold all 10
            pub.publish(_removed(i))
        assert pub.dropped_batches == 6
        kept = [pub._queue.get_nowait()[1][0].block_hashes[0][0] for _ in range(pub._queue.qsize())]
        assert kept == [6, 7, 8, 9]  # the newest batches
    finally:
        pub.shutdown()


def test_one_turn_serves_one_replay_request_and_the_queued_batches() -> None:
    pub = ManualPublisher(
        f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}", buffer_steps=100
    )
    assert pub._replay is not None and pub.replay_endpoint is not None
    assert pub._replay.getsockopt(zmq.RCVHWM) == 16  # pending replay requests are bounded
    ctx = zmq.Context()
    sub = _subscribe(ctx, pub.endpoint)
    dealer = ctx.socket(zmq.DEALER)
    dealer.setsockopt(zmq.RCVTIMEO, 300)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(pub.replay_endpoint)
    try:
        for i in range(5):
            pub.publish(_removed(i))
        assert pub._turn(wait=0)
        assert [int.from_bytes(sub.recv_multipart()[1], "big") for _ in range(5)] == [0, 1, 2, 3, 4]
        for _ in range(10):  # a flood of replay requests, each answered with the whole buffer
            dealer.send_multipart([b"", (0).to_bytes(8, "big")])
        assert pub._replay.poll(TIMEOUT_MS)
        time.sleep(0.2)
        for i in range(5, 8):
            pub.publish(_removed(i))
        assert pub._turn(wait=0)
        # The live batches went out in the same turn as one replay, not after the ten.
        assert [int.from_bytes(sub.recv_multipart()[1], "big") for _ in range(3)] == [5, 6, 7]
        answer = [dealer.recv_multipart() for _ in range(6)]
        assert [f[1] for f in answer][-1] == END_SEQ
        with pytest.raises(zmq.Again):  # the other nine wait for later turns
            dealer.recv_multipart()
        for _ in range(9):
            pub._turn(wait=0)
        ends = 0
        while ends < 9:
            ends += dealer.recv_multipart()[1] == END_SEQ
    finally:
        dealer.close()
        sub.close()
        pub.shutdown()
        ctx.term()


def test_shutdown_sends_what_is_queued() -> None:
    pub = KVEventPublisher(f"tcp://127.0.0.1:{free_port()}")
    ctx = zmq.Context()
    sub = _subscribe(ctx, pub.endpoint)
    for i in range(3):
        pub.publish(_removed(i))
    pub.shutdown()
    assert [int.from_bytes(sub.recv_multipart()[1], "big") for _ in range(3)] == [0, 1, 2]
    sub.close()
    ctx.term()


@pytest.mark.parametrize("host", ["*", "0.0.0.0"])
def test_a_wildcard_bind_is_logged_as_a_warning(host: str, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="engine.kv_event_publisher"):
        pub = KVEventPublisher(f"tcp://{host}:{free_port()}")
        pub.shutdown()
    assert any("every interface" in r.getMessage() for r in caplog.records)


def test_a_loopback_bind_is_not_warned_about(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level("WARNING", logger="engine.kv_event_publisher"):
        pub = KVEventPublisher(f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}")
        pub.shutdown()
    assert not caplog.records


@pytest.mark.parametrize(
    ("endpoint", "wild"),
    [
        ("tcp://*:5557", True),
        ("tcp://0.0.0.0:5557", True),
        ("tcp://[::]:5557", True),
        ("tcp://127.0.0.1:5557", False),
        ("tcp://10.0.0.2:5557", False),
        ("tcp://brine-1:5557", False),
    ],
)
def test_is_wildcard(endpoint: str, wild: bool) -> None:
    assert is_wildcard(endpoint) is wild
