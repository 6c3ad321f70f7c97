"""Write-behind for the Redis tier: one background thread sends queued SETs and DELs to Redis in
pipelines, so neither the store's lock nor a request ever waits on Redis for a write.

Invariants:
- a page put here is readable at once (`pending`) until its SET is acknowledged or failed;
- the queue holds at most `max_queued_bytes` of payload: a put beyond that is refused and
  reported lost at once (the store forgets that copy), so a slow or dead Redis costs memory
  bounded by that figure and never blocks the caller;
- a put whose SET fails (Redis down, timeout) is reported lost through `on_lost`; the page
  stays served by whichever local tier holds it, and the next store or demotion writes it again.
A lost DEL is not retried: Redis' TTL or maxmemory policy removes the stale page eventually,
and a stale page is still correct KV for its key.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Callable, Union

from kvstore.tiers.base import PageRecord, WriteTicket
from kvstore.tiers.redis_conn import FAULTS, Breaker

log = logging.getLogger("kvstore.redis")

DELETED = object()  # the pending marker of a key whose DEL is queued
MAX_BATCH_OPS = 64
MAX_BATCH_BYTES = 64 << 20

Op = tuple[bytes, Union[PageRecord, None]]  # (key, record to SET, or None to DEL)


class WriteBehind:
    def __init__(self, send: Callable[[list[Op]], list[bytes]], breaker: Breaker,
                 on_lost: Callable[[list[bytes]], None], max_queued_bytes: int) -> None:
        self._send = send  # runs one pipeline -> keys whose SET Redis refused; raises FAULTS when unreachable
        self._breaker = breaker
        self._on_lost = on_lost
        self._max_queued_bytes = max_queued_bytes
        self._queue: queue.Queue = queue.Queue()
        self._lock = threading.Lock()
        self._pending: dict[bytes, object] = {}  # key -> PageRecord or DELETED, until sent
        self._queued_bytes = 0
        self.written_pages = 0  # metrics
        self.refused_pages = 0  # puts refused: queue full or Redis known down
        self.failed_pages = 0  # SETs that failed on the wire
        self._thread = threading.Thread(target=self._run, name="kvstore-redis-writer", daemon=True)
        self._thread.start()

    @property
    def queued_bytes(self) -> int:
        return self._queued_bytes

    def pending(self, key: bytes) -> object:
        """The record queued for `key`, DELETED, or None when nothing is queued for it."""
        with self._lock:
            return self._pending.get(key)

    def put(self, record: PageRecord) -> WriteTicket:
        """Queue a SET; the ticket is set once it was sent or given up (never blocks)."""
        done = WriteTicket()
        nbytes = _nbytes(record)
        with self._lock:
            refuse = not self._breaker.available or self._queued_bytes + nbytes > self._max_queued_bytes
            if not refuse:
                self._queued_bytes += nbytes
                self._pending[record.key] = record
        if refuse:
            self.refused_pages += 1
            self._on_lost([record.key])
            done.set()
            return done
        self._queue.put((record.key, record, nbytes, done))
        return done

    def delete(self, key: bytes) -> None:
        with self._lock:
            self._pending[key] = DELETED
        self._queue.put((key, None, 0, None))

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued before this call was sent or given up."""
        done = threading.Event()
        self._queue.put((None, None, 0, done))
        return done.wait(timeout_s)

    def close(self, timeout_s: float) -> None:
        """Send what is queued (for at most `timeout_s`), then stop the thread."""
        if self._thread.is_alive():
            self._queue.put(None)
            self._thread.join(timeout_s)

    def _run(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            batch = [item]
            size = item[2]
            while len(batch) < MAX_BATCH_OPS and size < MAX_BATCH_BYTES:
                try:
                    item = self._queue.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._queue.put(None)  # stop after this batch
                    break
                batch.append(item)
                size += item[2]
            self._write(batch)

    def _write(self, batch: list) -> None:
        ops: list[Op] = [(key, record) for key, record, _, _ in batch if key is not None]
        lost: list[bytes] = []
        if ops:
            if self._breaker.allow():
                try:
                    lost = self._send(ops)
                    self._breaker.success()
                except FAULTS as exc:
                    self._breaker.failure(exc)
                    lost = [key for key, record in ops if record is not None]
                except Exception:  # a bug or a refused value must not kill the only writer
                    log.exception("redis tier: write of %d pages failed", len(ops))
                    lost = [key for key, record in ops if record is not None]
                self.failed_pages += len(lost)
                self.written_pages += sum(1 for _, record in ops if record is not None) - len(lost)
            else:  # Redis is known down: give up now rather than queue behind a dead socket
                lost = [key for key, record in ops if record is not None]
                self.failed_pages += len(lost)
        with self._lock:
            for key, record, nbytes, _ in batch:
                self._queued_bytes -= nbytes
                if key is not None and self._pending.get(key) is (record if record is not None else DELETED):
                    del self._pending[key]
        if lost:
            self._on_lost(lost)
        for _, _, _, done in batch:
            if done is not None:
                done.set()


def _nbytes(record: PageRecord) -> int:
    payload = record.payload
    if hasattr(payload, "numel"):
        return int(payload.numel() * payload.element_size())
    return len(memoryview(payload).cast("B"))

