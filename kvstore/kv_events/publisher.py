"""The sidecar's KV-event stream, on vLLM's ZeroMQ wire (`kvstore serve --kv-events-endpoint`).

Framed exactly as vLLM's `ZmqEventPublisher` frames it, so its subscribers (vLLM's own
decoder, llm-d's indexer, Dynamo's router) read it unchanged:

    PUB      (topic, 8-byte big-endian sequence number, msgpack KVEventBatch)
    ROUTER   a client sends (b"", 8-byte big-endian start sequence number); it gets back every
             buffered batch from there as (b"", topic, seq, payload), then (b"", b"", -1, b"")

The store hands records to `append` under its lock (kvstore/kv_events/recorder.py); that is a
bounded deque append and a counter, so a slow or absent subscriber never slows a store. One
background thread owns both sockets: every `batch_interval_s` it turns what is queued into one
batch (at most `max_batch_events` events), sends it, keeps it for replay, and answers replay
requests in between. Past `max_queue_records` queued records the queue stops taking them and
counts them (`dropped`); the thread then skips one sequence number (subscribers see the gap)
and asks the store for its whole picture again (`KVStore.resync_kv_events`): the next batches
start with AllBlocksCleared, so a subscriber that applies them is exact again. A subscriber the
PUB socket outpaces (ZeroMQ drops past `hwm`) sees a gap too and replays it from the ROUTER.
"""
from __future__ import annotations

import logging
import threading
from collections import deque
from dataclasses import dataclass
from typing import Any

import zmq

from kvstore.config import check_int
from kvstore.kv_events.packing import RecordPacker
from kvstore.kv_events.recorder import Record
from kvstore.kv_events.wire import now_s

log = logging.getLogger("kvstore.kv_events")
END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsPublisherConfig:
    endpoint: str  # PUB: "tcp://*:5557" or "tcp://127.0.0.1:5557" binds; as in vLLM
    replay_endpoint: str | None = None  # ROUTER for replays; None: no replay
    topic: str = ""
    max_queue_records: int = 100_000  # records waiting for the thread; past it they are dropped and counted
    replay_batches: int = 10_000  # batches kept for replay (vLLM's buffer_steps)
    max_batch_events: int = 1_000
    # A batch a tenth of a second: a router's picture lags that much, and the thread wakes seldom
    # enough not to take the interpreter from the store's threads (docs/kv_events.md, Cost).
    batch_interval_s: float = 0.1
    hwm: int = 100_000  # the PUB socket's high-water mark (messages)

    def __post_init__(self) -> None:
        for name in ("endpoint", "replay_endpoint"):
            value = getattr(self, name)
            if value is None and name == "replay_endpoint":
                continue
            if not isinstance(value, str) or "://" not in value:
                raise ValueError(f"kv_events_{name}: expected a ZeroMQ address like tcp://127.0.0.1:5557, "
                                 f"got {value!r}")
        if not isinstance(self.topic, str):
            raise ValueError(f"kv_events_topic: expected a string, got {self.topic!r}")
        check_int("kv_events_max_queue_records", self.max_queue_records, 1, 1 << 26)
        check_int("kv_events_replay_batches", self.replay_batches, 0, 1 << 24)
        check_int("max_batch_events", self.max_batch_events, 1, 1 << 20)
        check_int("hwm", self.hwm, 0, 1 << 30)
        if not (isinstance(self.batch_interval_s, (int, float)) and 0 < self.batch_interval_s <= 10):
            raise ValueError(f"batch_interval_s: must be in (0, 10], got {self.batch_interval_s!r}")


class KVEventsPublisher:
    """A `KVEventSink` that publishes on ZeroMQ. `start(store)` attaches it and starts the
    thread; `close()` sends what is queued and stops."""

    def __init__(self, config: KVEventsPublisherConfig, context: zmq.Context | None = None):
        self.config = config
        # Replaced whole by a resync (the snapshot first): the thread finishes the deque it holds
        # (records from before the snapshot) and then takes the new one, so order holds.
        self._queue: deque[Record] = deque()
        self._limit = config.max_queue_records  # the bound, plus the size of a snapshot queued
        self._behind = False
        self.dropped = 0  # records dropped past max_queue_records
        self.published_batches = 0
        self.published_events = 0
        self._buffer: deque[tuple[int, bytes]] = deque(maxlen=config.replay_batches or 1)
        self._seq = 0
        self._topic = config.topic.encode()
        self._packer = RecordPacker()
        self._store: Any = None
        self._ctx = context or zmq.Context.instance()
        self._pub = self._ctx.socket(zmq.PUB)
        self._replay: zmq.Socket | None = None
        try:
            self._pub.set_hwm(config.hwm)
            self._pub.bind(config.endpoint)
            if config.replay_endpoint is not None and config.replay_batches:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as exc:
            self._close_sockets()
            raise ValueError(f"kv_events: cannot bind {config.endpoint}"
                             f"{' / ' + config.replay_endpoint if config.replay_endpoint else ''}: {exc}") from None
        self.endpoint = self._pub.getsockopt_string(zmq.LAST_ENDPOINT)
        self.replay_endpoint = self._replay.getsockopt_string(zmq.LAST_ENDPOINT) if self._replay else None
        self._running = False
        self._wake = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kvstore-kv-events", daemon=True)

    # -- KVEventSink (under the store's lock) --------------------------------------------------
    def append(self, record: Record) -> None:
        if self._behind or len(self._queue) >= self._limit:
            self._behind = True
            self.dropped += 1
            return
        self._queue.append(record)

    def reset(self, records: list[Record]) -> None:
        self._limit = self.config.max_queue_records + len(records)
        self._queue = deque(records)  # what is still queued is superseded by the whole picture
        self._behind = False

    # -- lifecycle -------------------------------------------------------------------------------
    def start(self, store: Any) -> "KVEventsPublisher":
        self._store = store
        store.attach_kv_events(self)
        self._running = True
        self._thread.start()
        return self

    def close(self, timeout_s: float = 2.0) -> None:
        """Send what is queued (the store's closing AllBlocksCleared included), then stop."""
        if self._running:
            self._running = False
            self._wake.set()
            self._thread.join(timeout_s)
        if self._store is not None:
            self._store.detach_kv_events(self)
            self._store = None
        self._close_sockets()

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=100)

    @property
    def queued(self) -> int:
        return len(self._queue)

    # -- the thread ------------------------------------------------------------------------------
    def _run(self) -> None:
        interval_ms = int(self.config.batch_interval_s * 1000) or 1
        while True:
            running = self._running
            if self._replay is not None:
                while self._replay.poll(0):
                    self._serve_replay()
            try:
                self._send_pending()
            except Exception:  # never let a bad record stop the stream; the next resync repairs it
                log.exception("kv events: publishing failed; resyncing")
                self._behind = True
            if not running:
                return
            if self._replay is not None:
                self._replay.poll(interval_ms)
            else:
                self._wake.wait(self.config.batch_interval_s)

    def _send_pending(self) -> None:
        if self._behind and self._store is not None:
            self._seq += 1  # the dropped records' batch: a gap subscribers see
            self._store.resync_kv_events(self)
        # What is queued now goes out, in full batches and one partial one; what the store
        # queues meanwhile waits for the next round. (Draining until the queue is empty would
        # send a batch of one or two events per store under load, and each send hands the
        # interpreter to the store's threads and back.)
        limit = self.config.max_batch_events
        queue = self._queue
        left = len(queue)
        while left > 0:
            records = [queue.popleft() for _ in range(min(left, limit))]
            left -= len(records)
            self._send(records)
            if self._queue is not queue:  # a resync replaced it: the rest is superseded
                queue = self._queue
                left = len(queue)

    def _send(self, records: list[Record]) -> None:
        seq = self._seq
        self._seq += 1
        payload = self._packer.pack(now_s(), records, 0)
        self._pub.send_multipart((self._topic, seq.to_bytes(8, "big"), payload))
        if self._replay is not None:
            self._buffer.append((seq, payload))
        self.published_batches += 1
        self.published_events += len(records)

    def _serve_replay(self) -> None:
        assert self._replay is not None
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            log.warning("kv events: a replay request of %d frames ignored (expected identity, b'', start seq)",
                        len(frames))
            return
        client, _, start = frames
        first = int.from_bytes(start, "big")
        for seq, payload in list(self._buffer):
            if seq >= first:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))
