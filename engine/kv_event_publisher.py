"""Publishes the engine's KV cache events over ZMQ, as vLLM's `ZmqEventPublisher` does, for a KV-aware router.

Sockets: a PUB socket bound at `endpoint` sends each batch as `[topic, seq, payload]` (`engine.kv_event_wire`);
a ROUTER socket bound at `replay_endpoint` answers a subscriber that missed batches. A replay request is
`[identity, b"", start_seq]` (a DEALER or REQ client sends `[b"", start_seq]`); the answer is one
`[identity, b"", seq, payload]` per buffered batch with `seq >= start_seq`, oldest first, then
`[identity, b"", END_SEQ, b""]`. The last `buffer_steps` batches are kept for replay.

Threads: `publish()` is called by the engine's step thread and only enqueues; one daemon thread owns both
sockets (ZMQ sockets are not thread-safe), encodes, numbers, sends and serves replays. The events carry
prompt token ids: bind the endpoints to an interface only the router reaches.
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

_STOP = object()


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
    ) -> None:
        self.endpoint = endpoint
        self.replay_endpoint = replay_endpoint
        self.topic = topic
        self.buffer_steps = buffer_steps
        self.hwm = hwm
        self.data_parallel_rank = data_parallel_rank
        self._topic = topic.encode()
        self._queue: queue.Queue[Any] = queue.Queue()
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
                self._replay.bind(replay_endpoint)
        except zmq.ZMQError:
            self._close_sockets()
            raise
        self._thread = threading.Thread(target=self._run, name="brine-kv-events", daemon=True)
        self._thread.start()

    def publish(self, events: Sequence[KVCacheEvent]) -> None:
        """Queues one batch (nothing for an empty one). Never blocks the engine."""
        if events:
            self._queue.put((time.time(), list(events)))

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
        self._queue.put(_STOP)
        self._thread.join(timeout)

    # ---- the publisher thread --------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while True:
                if self._replay is not None:
                    while self._replay.poll(0):
                        self._serve_replay()
                try:
                    item = self._queue.get(timeout=0.02)
                except queue.Empty:
                    continue
                if item is _STOP:
                    break
                ts, events = item
                self._send(encode_batch(events, ts, self.data_parallel_rank))
        except Exception:  # the engine must keep serving even if the event stream dies
            logger.exception("KV event publisher stopped")
        finally:
            self._close_sockets()

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
