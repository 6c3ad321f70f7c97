"""Redis tier: page records in a Redis / Redis Cluster / Valkey deployment that many sidecars
share (docs/design.md §5). It is the bottom tier; the store decides what goes here and when.

- Key: `redis_key_prefix` + the 16-byte page key (namespace-scoped by construction: chained
  blake2b from the namespace). Value: one record, tiers/redis_record.py (the disk format: header
  with token ids and a checksum, payload optionally zstd), so a corrupt or foreign value is a miss,
  deleted and counted.
- Reads (`get_many`, `read_ahead`, `probe`) are pipelined GET / EXISTS, one round trip per batch;
  GET replies are received straight into one buffer per value (tiers/redis_reader.py, not
  redis-py's parser) and the record is decoded from there, or, for the `landings` a caller
  gives `read_ahead`, an uncompressed payload straight into the caller's buffers once its
  header is checked and accepted (tiers/redis_landing.py). Writes and deletes go through a
  write-behind thread (tiers/redis_writer.py) that pipelines them.
- Capacity is Redis' own: run it with a `maxmemory` and an evicting `maxmemory-policy`
  (allkeys-lru); a page Redis evicted (or whose `redis_ttl_s` ran out) is simply a miss, reported
  through `take_failed()` so the store forgets that copy. The tier never evicts by itself.
- Faults: every call is bounded by `redis_timeout_s`; a failure opens a breaker (redis_conn.py),
  during which the tier answers misses at once; it reconnects by itself after the backoff.

What it does not do: decide placement, probe prefixes or verify token ids against a request
(the store does; the record carries them).
"""
from __future__ import annotations

import logging
import threading
import time
from functools import partial
from itertools import islice
from typing import Any, Callable, Iterable, Iterator, Mapping, TypeVar
from urllib.parse import urlsplit, urlunsplit

import redis
import torch
import zstandard

from kvstore.config import StoreConfig
from kvstore.tiers.base import UNBOUNDED_BYTES, PageRecord, RecordTier, WriteTicket
from kvstore.tiers.disk_record import CorruptRecord
from kvstore.tiers.redis_conn import FAULTS, LOG_EVERY_S, Breaker, is_cluster_url, make_client
from kvstore.tiers.redis_landing import Landing, receive_record
from kvstore.tiers.redis_reader import Receiver, pipelined_gets
from kvstore.tiers.redis_record import decode_value, decode_value_header, encode_value
from kvstore.tiers.redis_writer import DELETED, Op, WriteBehind

log = logging.getLogger("kvstore.redis")
T = TypeVar("T")

MAX_QUEUED_BYTES = 256 << 20  # write-behind backlog before puts are refused (lost copies)
PROBE_FIRST_BATCH = 8  # EXISTS per round trip: a cold prompt costs one small batch ...
PROBE_MAX_BATCH = 512  # ... a long hit doubles it up to this
HEADER_READ_BYTES = 1 << 16  # scan reads this much of a value to parse its header
CLOSE_FLUSH_S = 5.0
READ_AHEAD = 2  # batches of one fetch whose GETs are on the wire at once


class RedisTier(RecordTier):
    name = "redis"
    shared = True
    batched_reads = True
    capacity_bytes = UNBOUNDED_BYTES  # Redis' maxmemory bounds it, not the store

    def __init__(self, config: StoreConfig) -> None:
        assert config.redis_url, "RedisTier needs StoreConfig.redis_url"
        self.url = config.redis_url
        self.cluster = is_cluster_url(config.redis_url)
        self._prefix = config.redis_key_prefix.encode()
        self._timeout_s = float(config.redis_timeout_s)
        self._ttl_s = config.redis_ttl_s
        self._zstd_level = config.zstd_level if config.disk_compression == "zstd" else None
        self._breaker = Breaker(_redacted(config.redis_url))
        self._client: Any = None
        self._client_lock = threading.Lock()
        self._failed: list[bytes] = []
        self._failed_lock = threading.Lock()
        self._local = threading.local()  # a zstd compressor per writer thread
        self.corrupt_records = 0
        self._refusal_logged_at = -LOG_EVERY_S
        self._refused_unlogged = 0
        self.missing_pages = 0  # GETs of pages believed held that Redis no longer had (evicted, expired)
        self._writer = WriteBehind(self._send, self._breaker, self._lost, MAX_QUEUED_BYTES)
        self.codec = config.disk_codec  # the disk's: a page demoted from disk goes down as it is

    @classmethod
    def from_config(cls, config: StoreConfig) -> "RedisTier | None":
        return cls(config) if config.redis_url else None

    # -- the tier interface (tiers/base.py RecordTier) -----------------------------------------
    @property
    def available(self) -> bool:
        """False while the breaker skips Redis after a failure (calls answer misses at once)."""
        return self._breaker.available

    def put(self, record: PageRecord) -> WriteTicket:
        """Queue the record for Redis; never blocks. The ticket is set once it was sent or lost
        (a loss is reported through take_failed, not the ticket)."""
        return self._writer.put(record)

    def delete(self, key: bytes) -> bool:
        self._writer.delete(key)
        return True

    def get(self, key: bytes) -> PageRecord | None:
        return self.get_many([key])[0]

    def get_many(self, keys: list[bytes], *, report_missing: bool = True) -> list[PageRecord | None]:
        """Records of `keys` in one pipelined round trip; None for misses and corrupt values.
        `report_missing`: a key Redis does not hold is reported through take_failed (the store
        believed it held; probes of keys nobody stored pass False)."""
        [results] = self._records([keys], report_missing, ahead=1)
        return results

    def read_ahead(self, batches: list[list[bytes]],
                   landings: Mapping[bytes, Landing] | None = None) -> Iterator[dict[bytes, PageRecord | None]]:
        """`get_many` of each batch, yielded in order as {key: record}, on one connection with
        the GETs of up to READ_AHEAD batches on the wire: Redis sends the next batch while the
        caller decodes this one. `landings`: buffers some keys' payloads go straight into when
        their headers are accepted (tiers/redis_landing.py); such a record's payload is its
        Landing. The buffers of a key that comes back otherwise hold garbage."""
        for b, records in enumerate(self._records(batches, True, READ_AHEAD, landings)):
            yield dict(zip(batches[b], records))

    def _records(self, batches: list[list[bytes]], report_missing: bool, ahead: int,
                 landings: Mapping[bytes, Landing] | None = None) -> Iterator[list[PageRecord | None]]:
        """The records of each batch, in order; keys queued in the write-behind are served
        from the queue (or are misses when a DEL is queued) without asking Redis."""
        plan: list[tuple[list[PageRecord | None], list[int]]] = []  # (results, indexes to read) per batch
        for keys in batches:
            results: list[PageRecord | None] = [None] * len(keys)
            wire: list[int] = []
            for i, key in enumerate(keys):
                queued = self._writer.pending(key)
                if queued is None:
                    wire.append(i)
                elif isinstance(queued, PageRecord):  # not DELETED
                    results[i] = queued
            plan.append((results, wire))
        wire_keys = [[keys[i] for i in wire] for keys, (_, wire) in zip(batches, plan)]
        receivers = None
        if landings and not self.cluster:
            receivers = [[self._receiver(key, landings.get(key)) for key in keys] for keys in wire_keys]
        stream = self._values(wire_keys, ahead, receivers)
        for (results, wire), keys, values in zip(plan, batches, stream):
            if values is None:  # Redis unreachable: misses, and the copies may still be there later
                yield results
                continue
            missing = []
            for i, value in zip(wire, values):
                if isinstance(value, PageRecord):  # received into its Landing, checksum verified
                    results[i] = value
                elif isinstance(value, CorruptRecord):
                    self._corrupt(keys[i], str(value))
                elif isinstance(value, (torch.Tensor, bytes, bytearray, memoryview)):
                    try:
                        results[i] = decode_value(value, keys[i])
                    except CorruptRecord as exc:
                        self._corrupt(keys[i], str(exc))
                elif report_missing:
                    missing.append(keys[i])  # None (gone) or a per-key error (e.g. WRONGTYPE)
            if missing:
                self.missing_pages += len(missing)
                self._lost(missing)
            yield results

    @staticmethod
    def _receiver(key: bytes, landing: Landing | None) -> Receiver | None:
        return None if landing is None else partial(receive_record, key=key, landing=landing)

    def _values(self, batches: list[list[bytes]], ahead: int,
                receivers: list[list[Receiver | None]] | None = None) -> Iterator[list[Any] | None]:
        """Redis' values of each batch of keys, in order; None for a batch not read because
        Redis is unreachable, slow, or skipped by the breaker."""
        done = 0
        if self._breaker.allow():
            try:
                client = self._redis()
                if self.cluster:  # the cluster client routes each key to its node: redis-py reads
                    source: Iterator[list[Any]] = (self._read(client, batch) if batch else [] for batch in batches)
                else:
                    wire_keys = [[self._prefix + key for key in batch] for batch in batches]
                    source = pipelined_gets(client.connection_pool, wire_keys,
                                            self._ttl_s, ahead, receivers)
                for values in source:
                    done += 1
                    if done == len(batches):  # before the last yield: a caller need not ask past it
                        self._breaker.success()
                    yield values
            except FAULTS as exc:
                self._breaker.failure(exc)
        for _ in range(done, len(batches)):
            yield None

    def probe(self, keys: Iterable[bytes]) -> int:
        """How many leading `keys` Redis (or the write-behind queue) holds: pipelined EXISTS in
        batches that double, stopping at the first miss; `keys` is consumed only that far.
        0 while Redis is unreachable."""
        it = iter(keys)
        found = 0
        batch = PROBE_FIRST_BATCH
        while chunk := list(islice(it, batch)):
            wire = [k for k in chunk if self._writer.pending(k) is None]
            present = self._call(lambda r: self._exists(r, wire)) if wire else []
            if present is None:
                return found
            held = dict(zip(wire, present))
            for key in chunk:
                queued = self._writer.pending(key)
                if not (held.get(key) or (queued is not None and queued is not DELETED)):
                    return found
                found += 1
            batch = min(batch * 2, PROBE_MAX_BATCH)
        return found

    def scan(self) -> Iterator[PageRecord]:
        """Headers (payload None) of every record under the key prefix. Costly: SCAN plus a
        GETRANGE per key; for tools and tests, not the request path."""
        client = self._call(lambda r: r)
        if client is None:
            return
        plen = len(self._prefix)
        for rkey in client.scan_iter(match=self._prefix + b"*", count=1000):
            key = bytes(rkey)[plen:]
            try:
                prefix = client.getrange(rkey, 0, HEADER_READ_BYTES - 1)
                record = decode_value_header(prefix, key)
                if record is None:
                    record = decode_value_header(client.getrange(rkey, 0, -1), key)
            except CorruptRecord as exc:
                self._corrupt(key, str(exc))
                continue
            if record is not None:
                yield record

    def __contains__(self, key: bytes) -> bool:
        return self.probe([key]) == 1

    def __len__(self) -> int:
        return sum(1 for _ in self._keys())

    def take_failed(self) -> list[bytes]:
        """Keys whose copies were lost: writes that failed, pages Redis evicted, corrupt values."""
        with self._failed_lock:
            failed, self._failed = self._failed, []
        return failed

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait for the write-behind queue (tests, benchmarks, close)."""
        return self._writer.flush(timeout_s)

    def stats(self) -> dict[str, int]:
        """Tier-specific counters, merged into the store's per-tier stats."""
        return {"up": int(self._breaker.available), "errors": self._breaker.failures,
                "skipped_calls": self._breaker.skipped, "missing_pages": self.missing_pages,
                "corrupt_records": self.corrupt_records, "written_pages": self._writer.written_pages,
                "refused_writes": self._writer.refused_pages, "failed_writes": self._writer.failed_pages,
                "queued_bytes": self._writer.queued_bytes}

    def close(self) -> None:
        self._writer.close(CLOSE_FLUSH_S)
        with self._client_lock:
            client, self._client = self._client, None
        if client is not None:
            try:
                client.close()
            except Exception:  # closing a dead connection must not fail the store's close
                pass

    # -- Redis calls -------------------------------------------------------------------------
    def _redis(self) -> Any:
        with self._client_lock:
            if self._client is None:
                self._client = make_client(self.url, self._timeout_s)
            return self._client

    def _call(self, fn: Callable[[Any], T]) -> T | None:
        """`fn(client)` under the breaker; None when Redis is down, slow or being skipped."""
        if not self._breaker.allow():
            return None
        try:
            result = fn(self._redis())
        except FAULTS as exc:
            self._breaker.failure(exc)
            return None
        self._breaker.success()
        return result

    def _pipeline(self, client: Any) -> Any:
        # The cluster pipeline routes each key to its node; both never wrap a MULTI transaction.
        return client.pipeline() if self.cluster else client.pipeline(transaction=False)

    def _read(self, client: Any, keys: list[bytes]) -> list[Any]:
        if len(keys) == 1:  # one page: a plain GET, no pipeline bookkeeping
            rkey = self._prefix + keys[0]
            try:
                return [client.getex(rkey, ex=self._ttl_s) if self._ttl_s else client.get(rkey)]
            except redis.exceptions.ResponseError as exc:  # e.g. WRONGTYPE: a miss, as in a pipeline
                return [exc]
        pipe = self._pipeline(client)
        for key in keys:
            if self._ttl_s:
                pipe.getex(self._prefix + key, ex=self._ttl_s)  # a page in use stays alive
            else:
                pipe.get(self._prefix + key)
        return pipe.execute(raise_on_error=False)

    def _exists(self, client: Any, keys: list[bytes]) -> list[bool]:
        pipe = self._pipeline(client)
        for key in keys:
            pipe.exists(self._prefix + key)
        results = pipe.execute(raise_on_error=False)
        return [result is True or (isinstance(result, int) and result > 0) for result in results]

    def _send(self, ops: list[Op]) -> list[bytes]:
        """One pipeline of SETs and DELs (the writer thread); keys whose SET Redis refused."""
        compressor = self._compressor()
        pipe = self._pipeline(self._redis())
        for key, record in ops:
            if record is None:
                pipe.delete(self._prefix + key)
            else:
                pipe.set(self._prefix + key, encode_value(record, compressor), ex=self._ttl_s)
        results = pipe.execute(raise_on_error=False)
        refused = [key for (key, record), result in zip(ops, results)
                   if record is not None and isinstance(result, Exception)]
        if refused:  # e.g. OOM under maxmemory-policy noeviction: not a fault of the connection
            self._log_refusal(len(refused), next(r for r in results if isinstance(r, Exception)))
        return refused

    def _compressor(self) -> zstandard.ZstdCompressor | None:
        if self._zstd_level is None:
            return None
        compressor = getattr(self._local, "zstd", None)
        if compressor is None:
            compressor = self._local.zstd = zstandard.ZstdCompressor(level=self._zstd_level)
        return compressor

    def _keys(self) -> Iterator[bytes]:
        client = self._call(lambda r: r)
        if client is not None:
            yield from client.scan_iter(match=self._prefix + b"*", count=1000)

    # -- lost copies -------------------------------------------------------------------------
    def _lost(self, keys: list[bytes]) -> None:
        with self._failed_lock:
            self._failed.extend(keys)

    def _corrupt(self, key: bytes, why: str) -> None:
        self.corrupt_records += 1
        log.warning("redis tier: corrupt record %s deleted (%s)", key.hex(), why)
        self.delete(key)
        self._lost([key])

    def _log_refusal(self, count: int, exc: BaseException) -> None:
        now = time.monotonic()
        self._refused_unlogged += count
        if now - self._refusal_logged_at >= LOG_EVERY_S:
            log.warning("redis tier: Redis refused %d page(s) since the last report: %s "
                        "(run it with maxmemory-policy allkeys-lru)", self._refused_unlogged, exc)
            self._refusal_logged_at, self._refused_unlogged = now, 0


def _redacted(url: str) -> str:
    """The URL without its password, for log lines."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    netloc = f"{parts.username or ''}:***@{parts.hostname or ''}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit(parts._replace(netloc=netloc))
