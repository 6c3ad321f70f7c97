"""Disk tier: page records in an LMDB environment under `data_dir`.

py-lmdb idioms: one writer thread owns every write transaction (LMDB allows one writer; batching
many puts into one commit is what makes it fast), readers open short read-only transactions from
any thread, and the map grows by doubling on `MapFullError` up to `capacity_bytes`.

Two sub-databases: `meta` (key -> checksummed header) and `data` (key -> payload). Rebuilding the
index at start scans `meta` only. Records written but not yet committed are served from
`_pending`, so a page is readable the moment `put` returns. `put` returns a `threading.Event`
that is set once the record is committed (write-through waits for it).

Reads: one read transaction per batch of keys (`read_ahead`), in tiers/disk_reader.py: a
payload is copied once, out of the map into where the caller keeps it, and checksummed there.

What the tier does not do: decide capacity or eviction (the store's placement does); a write
that still fails at the largest map size is reported through `take_failed()` so the store can
forget that copy.
"""
from __future__ import annotations

import logging
import os
import queue
import shutil
import threading
from typing import TYPE_CHECKING, Iterator, Mapping

import lmdb
import zstandard

from kvstore.tiers.base import PageRecord, RecordTier, WriteTicket
from kvstore.tiers.disk_open import open_environment
from kvstore.tiers.disk_reader import DiskReader, MapLock
from kvstore.tiers.disk_record import CorruptRecord, decode_header, encode_header, header_to_record

if TYPE_CHECKING:
    from kvstore.config import StoreConfig
    from kvstore.tiers.redis_landing import Landing

log = logging.getLogger("kvstore.disk")

INITIAL_MAP_BYTES = 64 << 20
_DELETE = object()
_STOP = object()
MAX_BATCH_BYTES = 64 << 20
DISK_FILL_FRACTION = 0.9  # LMDB needs room for its own pages beyond the records:
LMDB_RESERVED_BYTES = 128 << 10  # 10% for B-tree pages and the free list, plus its meta pages


class DiskTier(RecordTier):
    name = "disk"
    persistent = True
    batched_reads = True  # one read transaction per batch, payloads copied out of the map into landings

    def __init__(self, path: str, capacity_bytes: int, *, compression: str = "none",
                 zstd_level: int = 1, sync: bool = False, queue_pages: int = 256, codec: str = "none"):
        if capacity_bytes <= 0:
            raise ValueError(f"disk_bytes: must be > 0 for a disk tier, got {capacity_bytes}")
        os.makedirs(path, exist_ok=True)
        self.path = path
        self.capacity_bytes = capacity_bytes
        self.codec = codec
        self.compression = compression
        self._zstd_level = zstd_level
        self._map_bytes = min(capacity_bytes, INITIAL_MAP_BYTES)
        existing = os.path.join(path, "data.mdb")
        existing_bytes = os.path.getsize(existing) if os.path.exists(existing) else 0
        # A filesystem smaller than disk_bytes: the store's accounting must evict before the
        # disk says ENOSPC, or every write past that point fails and its page is lost.
        room = existing_bytes + shutil.disk_usage(path).free
        if room < capacity_bytes:
            log.warning("disk tier: disk_bytes %d exceeds what the filesystem under %s holds (%d bytes "
                        "with this tier's file); using %d", capacity_bytes, path, room, room)
            self.capacity_bytes = capacity_bytes = room
            self._map_bytes = min(self._map_bytes, capacity_bytes)
        if existing_bytes:  # reopen at least as large as the file already is
            self._map_bytes = max(self._map_bytes, min(capacity_bytes, existing_bytes))
        # A damaged environment is moved aside here and the tier starts empty (disk_open.py).
        self.env = open_environment(path, self._map_bytes, sync=sync)
        self._meta = self.env.open_db(b"meta")
        self._data = self.env.open_db(b"data")
        self._rw = MapLock()
        self._pending: dict[bytes, object] = {}  # key -> PageRecord or _DELETE, until committed
        self._pending_lock = threading.Lock()
        self._queue: queue.Queue = queue.Queue(maxsize=queue_pages)
        self._failed: list[bytes] = []
        self._reader = DiskReader(self.env, self._meta, self._data, self._rw, self._corrupt)
        self.corrupt_records = 0
        self.write_errors = 0
        self._writer = threading.Thread(target=self._write_loop, name="kvstore-disk-writer", daemon=True)
        self._writer.start()

    @classmethod
    def from_config(cls, config: "StoreConfig") -> "DiskTier | None":
        if not config.disk_bytes or not config.data_dir:  # the config refuses disk_bytes without a data_dir
            return None
        return cls(os.path.join(config.data_dir, "pages"), config.disk_bytes,
                   compression=config.disk_compression, zstd_level=config.zstd_level,
                   sync=config.durability == "write-through", queue_pages=config.disk_writer_queue,
                   codec=config.disk_codec)

    @property
    def fillable_bytes(self) -> int:
        # Of the tier's capacity, not disk_bytes: it is smaller on a filesystem with less room.
        return max(0, int(self.capacity_bytes * DISK_FILL_FRACTION) - LMDB_RESERVED_BYTES)

    def _entries(self) -> int:
        with self.env.begin(db=self._meta) as txn:
            return txn.stat(self._meta)["entries"]

    # -- the tier interface (tiers/base.py RecordTier) -----------------------------------------
    def put(self, record: PageRecord) -> "WriteTicket":
        done = WriteTicket()
        with self._pending_lock:
            self._pending[record.key] = record
        self._queue.put((record.key, record, done))
        return done

    def delete(self, key: bytes) -> bool:
        self._reader.forget(key)
        with self._pending_lock:
            self._pending[key] = _DELETE
        self._queue.put((key, _DELETE, None))
        return True

    def get(self, key: bytes) -> PageRecord | None:
        return self._read_batch([key], None)[key]

    def read_ahead(self, batches: list[list[bytes]],
                   landings: Mapping[bytes, Landing] | None = None) -> Iterator[dict[bytes, PageRecord | None]]:
        """The records of each batch, one read transaction per batch. A key of `landings` whose
        record is intact, uncompressed, sized for its rows and accepted gets its payload copied
        straight out of the map into them (its record's payload is then that Landing). As with
        Redis, the rows of a key that comes back otherwise may hold garbage (a payload that
        failed its checksum there): the caller serves nothing from them."""
        for batch in batches:
            yield self._read_batch(batch, landings)

    def _read_batch(self, keys: list[bytes],
                    landings: Mapping[bytes, Landing] | None) -> dict[bytes, PageRecord | None]:
        records: dict[bytes, PageRecord | None] = dict.fromkeys(keys)
        to_read = keys
        # A key whose last write is still queued is answered from `_pending`. Tested without the
        # lock first (one dict test; under the GIL it is either empty or not): when it is empty,
        # every write `put` has returned for is committed, so the reader's transaction sees it.
        if self._pending:
            to_read = []
            with self._pending_lock:
                for key in keys:
                    pending = self._pending.get(key)
                    if pending is None:
                        to_read.append(key)
                    elif isinstance(pending, PageRecord):  # not _DELETE
                        records[key] = pending
        self._reader.read_into(records, to_read, landings)
        return records

    def __contains__(self, key: bytes) -> bool:
        with self._pending_lock:
            pending = self._pending.get(key)
        if pending is not None:
            return pending is not _DELETE
        try:
            with self.env.begin(db=self._meta) as txn:
                return txn.get(key) is not None
        except lmdb.Error:  # damaged under this key: get() will count and delete it
            return False

    def __len__(self) -> int:
        return self._entries()

    def scan(self) -> Iterator[PageRecord]:
        """Headers of every intact record (payload None); malformed ones are deleted and counted."""
        bad: list[tuple[bytes, str]] = []
        with self.env.begin(db=self._meta) as txn:
            for key, value in txn.cursor():
                try:
                    yield header_to_record(decode_header(value, key))
                except CorruptRecord as exc:
                    bad.append((key, str(exc)))
        for key, why in bad:
            self._corrupt(key, why)

    def _corrupt(self, key: bytes, why: str) -> None:
        self.corrupt_records += 1
        log.warning("disk tier: corrupt record %s deleted (%s)", key.hex(), why)
        self.delete(key)
        with self._pending_lock:
            self._failed.append(key)

    def take_failed(self) -> list[bytes]:
        """Keys whose records were lost (corrupt, or not writable at the largest map size)."""
        with self._pending_lock:
            failed, self._failed = self._failed, []
        return failed

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until everything queued before this call is committed. False on timeout."""
        done = threading.Event()
        self._queue.put((None, None, done))
        return done.wait(timeout_s)

    def close(self) -> None:
        if self._writer.is_alive():
            self._queue.put((None, _STOP, None))
            self._writer.join()
        self.env.sync(True)
        self.env.close()

    # -- the writer thread -------------------------------------------------------------------
    def _write_loop(self) -> None:
        compressor = zstandard.ZstdCompressor(level=self._zstd_level) if self.compression == "zstd" else None
        stop = False
        while not stop:
            batch = [self._queue.get()]
            batch_bytes = 0
            while len(batch) < 1024 and batch_bytes < MAX_BATCH_BYTES:
                try:
                    batch.append(self._queue.get_nowait())
                except queue.Empty:
                    break
                item = batch[-1][1]
                if isinstance(item, PageRecord):
                    batch_bytes += len(_as_bytes(item.payload))
            stop = any(op is _STOP for _, op, _ in batch)
            ops: list[tuple[bytes, bytes | None, bytes | memoryview | None, object]] = []
            for key, op, done in batch:
                if isinstance(op, PageRecord):
                    payload = _as_bytes(op.payload)
                    stored = compressor.compress(payload) if compressor else payload
                    comp = "zstd" if compressor else "none"
                    ops.append((key, encode_header(op, compression=comp, stored_payload=stored), stored, op))
                elif op is _DELETE:
                    ops.append((key, None, None, op))
            failed = self._commit(ops)
            with self._pending_lock:
                for key, _, _, op in ops:
                    if self._pending.get(key) is op:
                        del self._pending[key]
            for key, _, done in batch:
                if done is not None:
                    done.ok = key not in failed
                    done.set()

    def _apply(self, txn: lmdb.Transaction, key: bytes, meta: bytes | None, payload) -> None:
        """One op in a write transaction: a put of header + payload, or (meta None) a delete."""
        if meta is None:
            txn.delete(key, db=self._meta)
            txn.delete(key, db=self._data)
        else:
            txn.put(key, meta, db=self._meta)
            txn.put(key, payload, db=self._data)

    def _commit(self, ops: list) -> set[bytes]:
        """Write one batch; the keys of puts that could not be written."""
        while True:
            try:
                with self.env.begin(write=True) as txn:
                    for key, meta, payload, _ in ops:
                        self._apply(txn, key, meta, payload)
                return set()
            except lmdb.MapFullError:
                if self._map_bytes >= self.capacity_bytes:
                    break
                self._grow()
            except lmdb.Error as exc:  # e.g. the disk itself is full
                log.error("disk tier: write of %d records failed: %s", len(ops), exc)
                break
        # Nothing of this batch was committed; deletes are retried one by one (they free room),
        # puts are reported lost so the store forgets those copies.
        self.write_errors += 1
        failed: set[bytes] = set()
        for key, meta, payload, _ in ops:
            try:
                with self.env.begin(write=True) as txn:
                    self._apply(txn, key, meta, payload)
            except lmdb.Error:
                if meta is not None:
                    failed.add(key)
                    with self._pending_lock:
                        self._failed.append(key)
        return failed

    def _grow(self) -> None:
        new_bytes = min(self.capacity_bytes, self._map_bytes * 2)
        self._rw.acquire_write()
        try:
            self.env.set_mapsize(new_bytes)
        finally:
            self._rw.release_write()
        log.info("disk tier: map grown from %d to %d bytes", self._map_bytes, new_bytes)
        self._map_bytes = new_bytes


def _as_bytes(payload) -> bytes | memoryview:
    """A flat byte view of a payload given as bytes, a memoryview or a uint8 torch tensor."""
    if hasattr(payload, "numpy"):
        return memoryview(payload.contiguous().numpy()).cast("B")
    return memoryview(payload).cast("B")
