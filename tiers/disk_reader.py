"""The disk tier's read path: records out of the LMDB map, one read transaction per batch.

Reads open a read-only transaction with `buffers=True`, so a value is a view into the map and a
payload is copied once, out of the map into where the caller keeps it (a fetch answer's slices,
`landings`: one strided copy a page; or a fresh tensor), and its checksum is verified over that
copy, while it is in cache. A header is decoded once per key and the bytes it was decoded from
(`_header`): a record whose header changed on disk in any byte is decoded afresh.

Records the writer has not committed yet are the tier's (`DiskTier._pending`): it answers those
itself and asks the reader for the rest. A record that fails its checks is reported to the tier
(`corrupt`), which deletes and counts it, once the batch's transaction is over.

Kept apart from tiers/disk.py (the tier, its writer thread) as the Redis tier's reader is
(tiers/redis_reader.py): what a read does to the bytes, and the tier's bookkeeping, change
for different reasons.
"""
from __future__ import annotations

import threading
from collections import deque
from typing import TYPE_CHECKING, Callable, Mapping

import lmdb
import numpy as np
import torch
import zstandard

from kvstore.tiers.base import PageRecord
from kvstore.tiers.disk_record import CorruptRecord, decode_header, header_to_record, payload_checksum, payload_digest

if TYPE_CHECKING:
    from kvstore.tiers.redis_landing import Landing

HEADER_CACHE_ENTRIES = 4096  # decoded headers kept (a header is its token ids plus ~150 bytes)


class MapLock:
    """Many readers or one map resizer: LMDB's set_mapsize needs no open transaction in the
    process. Reads take it on every batch and resizes are rare, so a reader takes one plain
    mutex twice and notifies only when a resizer waits; a waiting resizer holds new readers
    back (a steady stream of reads cannot starve it)."""

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._changed = threading.Condition(self._mutex)  # readers reached 0, or the resizer is done
        self._readers = 0
        self._writer = False  # a resizer holds it or waits for it

    def acquire_read(self) -> None:
        with self._mutex:
            while self._writer:
                self._changed.wait()
            self._readers += 1

    def release_read(self) -> None:
        with self._mutex:
            self._readers -= 1
            if self._writer and not self._readers:
                self._changed.notify_all()

    def acquire_write(self) -> None:
        with self._mutex:
            while self._writer:  # one resizer at a time (only the writer thread resizes)
                self._changed.wait()
            self._writer = True
            while self._readers:
                self._changed.wait()

    def release_write(self) -> None:
        with self._mutex:
            self._writer = False
            self._changed.notify_all()


class DiskReader:
    """Batches of records out of `env`'s `meta` (headers) and `data` (payloads) sub-databases."""

    def __init__(self, env: lmdb.Environment, meta: lmdb._Database, data: lmdb._Database, map_lock: MapLock,
                 corrupt: Callable[[bytes, str], None]):
        self.env = env
        self._meta = meta
        self._data = data
        self._rw = map_lock  # held for each batch: the map is not resized under a read
        self._corrupt = corrupt  # the tier deletes and counts a record that failed its checks
        # key -> (header bytes, what `_header` decoded from them)
        self._headers: dict[bytes, tuple[bytes, tuple[PageRecord, str, int, int]]] = {}

    def forget(self, key: bytes) -> None:
        """`key`'s record is being deleted: drop its decoded header."""
        self._headers.pop(key, None)

    def read_into(self, records: dict[bytes, PageRecord | None], keys: list[bytes],
                  landings: Mapping[bytes, Landing] | None) -> None:
        """The records of `keys` (None: not there, or corrupt) into `records`, in one read
        transaction (a fresh one after an LMDB error)."""
        bad: list[tuple[bytes, str]] = []
        txn: lmdb.Transaction | None = None
        self._rw.acquire_read()
        try:
            # buffers=True: values are views into the map, valid until the transaction ends; every
            # byte a caller keeps is copied out of them (into its landing or a fresh tensor) first.
            for key in keys:
                try:
                    if txn is None:
                        txn = self.env.begin(buffers=True)
                    records[key] = self._read(txn, key, landings.get(key) if landings else None)
                except (CorruptRecord, zstandard.ZstdError) as exc:
                    bad.append((key, str(exc)))
                except lmdb.Error as exc:  # a damaged B-tree or overflow page under this record
                    bad.append((key, f"{type(exc).__name__}: {exc}"))
                    if txn is not None:
                        txn.abort()  # it may be unusable now: the next key gets a fresh one
                        txn = None
        finally:
            if txn is not None:
                txn.abort()
            self._rw.release_read()
        for key, why in bad:  # after the lock: a delete may wait on the writer, which may wait on it
            self._corrupt(key, why)

    def _read(self, txn: lmdb.Transaction, key: bytes, landing: Landing | None) -> PageRecord | None:
        """One record out of a read transaction with buffers; raises CorruptRecord. An
        uncompressed payload is checksummed where it was copied to, right after the copy (in
        cache then; the map's bytes are read once): the bytes verified are the bytes served."""
        meta = txn.get(key, db=self._meta)
        if meta is None:
            return None
        payload = txn.get(key, db=self._data)
        head, compression, size, checksum = self._header(key, meta)
        if payload is None or len(payload) != size:
            raise CorruptRecord("payload size mismatch")
        if compression == "zstd":
            if payload_checksum(payload) != checksum:
                raise CorruptRecord("payload checksum mismatch")
            return head.with_payload(zstandard.ZstdDecompressor().decompress(payload))
        if landing is not None and landing.rows.nbytes == size and landing.accepts(head):
            rows = landing.rows
            np.copyto(rows, np.frombuffer(payload, dtype=np.uint8).reshape(rows.shape))
            if rows.flags.c_contiguous:  # one piece (a one-page answer, or a single row)
                served = payload_checksum(rows)
            else:  # the streaming xxh3-64, row by row: the same digest over the same bytes
                digest = payload_digest()
                deque(map(digest.update, rows), maxlen=0)  # each row in order, no Python loop per row
                served = digest.intdigest()
            if served != checksum:
                raise CorruptRecord("payload checksum mismatch")
            return head.with_payload(landing)
        copy = torch.empty(size, dtype=torch.uint8)
        copied = copy.numpy()
        np.copyto(copied, np.frombuffer(payload, dtype=np.uint8))
        if payload_checksum(copied) != checksum:
            raise CorruptRecord("payload checksum mismatch")
        return head.with_payload(copy)

    def _header(self, key: bytes, meta: bytes | memoryview) -> tuple[PageRecord, str, int, int]:
        """What a read needs of `key`'s header: its record (payload None), compression, stored
        size and payload checksum. Decoding (crc32, msgpack, field checks) is remembered per key
        with the header bytes it was decoded from: it is a function of those bytes, so a record
        whose header changed on disk in any byte is decoded and checked afresh, and the payload
        checksum is still verified on every read."""
        value = bytes(meta)  # then compared as bytes: a memoryview compares byte by byte
        cached = self._headers.get(key)
        if cached is not None and cached[0] == value:
            return cached[1]
        header = decode_header(value, key)
        found = (header_to_record(header), header["comp"], header["size"], header["checksum"])
        if len(self._headers) >= HEADER_CACHE_ENTRIES:
            self._headers.clear()  # bounded, no recency bookkeeping: a re-read decodes again
        self._headers[key] = (value, found)
        return found
