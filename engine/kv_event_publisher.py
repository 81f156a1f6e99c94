"""Publishes the engine's KV cache events over ZMQ, as vLLM's `ZmqEventPublisher` does, for a KV-aware router.

Sockets: a PUB socket bound at `endpoint` sends each batch as `[topic, seq, payload]` (`engine.kv_event_wire`);
a ROUTER socket bound at `replay_endpoint` answers a subscriber that missed batches. A replay request is
`[identity, b"", start_seq]` (a DEALER or REQ client sends `[b"", start_seq]`); the answer is one
`[identity, b"", seq, payload]` per buffered batch with `seq >= start_seq`, oldest first, then
`[identity, b"", END_SEQ, b""]`. The last `buffer_steps` batches are kept for replay.

Threads: `publish()` is called by the engine's step thread and only enqueues; one daemon thread owns both
sockets (ZMQ sockets are not thread-safe), encodes, numbers, sends and serves replays.

Bounds, so that neither a slow publisher nor a subscriber can hold the engine or the live stream:
- the queue from the engine holds at most `max_queued_batches`; when full, `publish` drops the oldest batch
  (counted in `dropped_batches`, logged) rather than block the step thread or grow without end. A router that
  missed a batch sees a gap in nothing (numbers are given at send time) but may route on stale blocks;
- each turn of the publisher thread serves at most one replay request, then sends up to `batches_per_turn`
  queued batches, so a flood of replay requests delays the live stream by one replay, not by the flood;
- the replay socket queues at most `max_pending_replays` requests (ZMQ's receive high-water mark; beyond it
  ZMQ drops them).

The events carry prompt token ids: bind the endpoints to an interface only the router reaches. A wildcard
bind (`tcp://*`, `0.0.0.0`, `::`) is logged as a warning.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any

import zmq

from engine.kv_event_wire import END_SEQ, encode_batch, seq_bytes
from kv_cache.stats import KVCacheEvent

logger = logging.getLogger(__name__)

_WILDCARD_HOSTS = frozenset({"*", "0.0.0.0", "::", "[::]", "[::0]", "::0"})
_DROP_LOG_INTERVAL_S = 10.0


def is_wildcard(endpoint: str) -> bool:
    """True for a tcp endpoint bound to every interface (`tcp://*:5557`, `tcp://0.0.0.0:5557`, `tcp://[::]:..`)."""
    if not endpoint.startswith("tcp://"):
        return False
    host = endpoint[len("tcp://") :].rpartition(":")[0]
    return host in _WILDCARD_HOSTS


def replay_endpoint_for(endpoint: str) -> str:
    """The replay socket's default address: the event endpoint's host, its port + 1 (`tcp://h:5557` ->
    `tcp://h:5558`)."""
    head, sep, port = endpoint.rpartition(":")
    if not sep or not port.isdigit() or not endpoint.startswith("tcp://"):
        raise ValueError(f"a KV events endpoint must be tcp://HOST:PORT, not {endpoint!r}")
    return f"{head}:{int(port) + 1}"


class KVEventPublisher:
    """Every batch passed to `publish` is sent exactly once, in order, numbered from 0 without gaps."""

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None = None,
        *,
        topic: str = "",
        buffer_steps: int = 10_000,
        hwm: int = 100_000,
        data_parallel_rank: int = 0,
        max_queued_batches: int = 10_000,
        batches_per_turn: int = 64,
        max_pending_replays: int = 16,
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.data_parallel_rank = data_parallel_rank
        self._topic = topic.encode()
        self.batches_per_turn = batches_per_turn
        self.dropped_batches = 0  # written by the engine's thread only
        self._last_drop_log = float("-inf")
        self._queue: queue.Queue[tuple[float, list[KVCacheEvent]]] = queue.Queue(maxsize=max_queued_batches)
        self._stopping = threading.Event()
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=buffer_steps)
        self._next_seq = 0
        self._ctx = zmq.Context()
        # Bound here, not in the thread: a taken port fails `brine serve` at startup, not silently later.
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.set_hwm(hwm)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.bind(endpoint)
            if replay_endpoint is not None:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.RCVHWM, max_pending_replays)
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        for bound in (endpoint, replay_endpoint):
            if bound is not None and is_wildcard(bound):
                logger.warning(
                    "KV events are bound to every interface (%s): any host that reaches this port reads the "
                    "prompt token ids of every tenant; bind to an address only the router reaches",
                    bound,
                )
        self._thread = threading.Thread(target=self._run, name="brine-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        """Queues one batch (nothing for an empty one). Never blocks the engine: when the queue is full, the
        oldest queued batch is dropped (and counted) to make room."""
        if not events:
            return
        item = (time.time(), list(events))
        while True:
            try:
                self._queue.put_nowait(item)
                return
            except queue.Full:
                try:
                    self._queue.get_nowait()
                except queue.Empty:  # the publisher thread took one meanwhile: room again
                    continue
                self._count_drop()

    def _count_drop(self) -> None:
        self.dropped_batches += 1
        now = time.monotonic()
        if now - self._last_drop_log >= _DROP_LOG_INTERVAL_S:
            self._last_drop_log = now
            logger.warning(
                "KV event queue full: dropped the oldest batch (%d dropped so far); a router may route on "
                "stale blocks",
                self.dropped_batches,
            )

    def source(self) -> dict[str, Any]:
        """This publisher as one entry of `GET /kv_event_sources` (vLLM's KVEventsConfig fields)."""
        return {
            "enable_kv_cache_events": True,
            "publisher": "zmq",
            "endpoint": self.endpoint,
            "replay_endpoint": self.replay_endpoint,
            "topic": self.topic,
            "buffer_steps": self.buffer_steps,
            "hwm": self.hwm,
        }

    def shutdown(self, timeout: float = 2.0) -> None:
        """Sends what is queued (within `timeout`), then closes the sockets."""
        self._stopping.set()
        self._thread.join(timeout)

    # ---- the publisher thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while self._turn():
                pass
        except Exception:  # the engine must keep serving even if the event stream dies
            logger.exception("KV event publisher stopped")
        finally:
            self._close_sockets()

    def _turn(self, wait: float = 0.02) -> bool:
        """One turn: at most one replay request, then up to `batches_per_turn` queued batches (waiting up to
        `wait` for the first when no replay was served). False once stopping and nothing is left to send."""
        served = self._replay is not None and bool(self._replay.poll(0))
        if served:
            self._serve_replay()
        for i in range(self.batches_per_turn):
            try:
                ts, events = self._queue.get(timeout=wait) if not (i or served) else self._queue.get_nowait()
            except queue.Empty:
                return not self._stopping.is_set() or served
            self._send(encode_batch(events, ts, self.data_parallel_rank))
        return True

    def _send(self, payload: bytes) -> None:
        seq = self._next_seq
        self._next_seq += 1
        self._pub.send_multipart((self._topic, seq_bytes(seq), payload))
        self._buffer.append((seq, payload))

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or frames[1] != b"" or len(frames[2]) != 8:
            logger.warning("ignored a malformed KV event replay request (%d frames)", len(frames))
            return
        identity, _, start = frames
        start_seq = int.from_bytes(start, "big", signed=True)
        for seq, payload in self._buffer:
            if seq >= start_seq:
                self._replay.send_multipart((identity, b"", seq_bytes(seq), payload))
        self._replay.send_multipart((identity, b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        self._pub.close(linger=0)
        if self._replay is not None:
            self._replay.close(linger=0)
        self._ctx.term()
