"""The Redis tier on its own: records round-trip bit-exact through one Redis value, reads and
probes are pipelined, a corrupt or foreign value is a miss (deleted, counted, reported), a key
Redis evicted is reported lost, TTLs are set, and a dead or paused Redis answers misses within
the timeout and is reconnected to by itself."""
from __future__ import annotations

import time

import pytest
import torch
from redis_helpers import RedisServer

from kvstore import StoreConfig
from kvstore.keys import page_key, tokens_bytes
from kvstore.tiers.base import PageRecord
from kvstore.tiers.redis import RedisTier
from kvstore.tiers.redis_record import decode_value, encode_value

PREFIX = "t:"


def record(i: int, nbytes: int = 4096, parent: bytes = b"\0" * 16) -> PageRecord:
    tokens = tokens_bytes([i, i + 1, i + 2, i + 3])
    payload = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=torch.Generator().manual_seed(i))
    return PageRecord(namespace=b"n" * 16, key=page_key(parent, tokens), parent=parent, tokens=tokens,
                      codec="none", dtype="float16", shape=(1, 2, 4, 1, nbytes // 16), payload=payload)


def make_tier(server: RedisServer, **overrides) -> RedisTier:
    fields = {"data_dir": None, "cpu_bytes": 1 << 20, "disk_bytes": 0, "redis_url": server.url,
              "redis_key_prefix": PREFIX, "redis_timeout_s": 0.3}
    fields.update(overrides)
    return RedisTier(StoreConfig(**fields))


def payload_of(rec: PageRecord) -> bytes:
    if hasattr(rec.payload, "numpy"):
        return rec.payload.numpy().tobytes()
    return bytes(memoryview(rec.payload).cast("B"))


@pytest.fixture
def tier(redis_server: RedisServer):
    t = make_tier(redis_server)
    yield t
    t.close()


def test_value_format_roundtrips_and_rejects_garbage():
    rec = record(1)
    value = encode_value(rec, None)
    back = decode_value(value, rec.key)
    assert ((back.tokens, back.shape, back.parent, payload_of(back))
            == (rec.tokens, rec.shape, rec.parent, payload_of(rec)))
    from kvstore.tiers.disk_record import CorruptRecord

    for bad in (b"", b"\1\0", value[:-1], value[:-1] + bytes([value[-1] ^ 1]), b"\xff\xff\xff\x7f" + value[4:]):
        with pytest.raises(CorruptRecord):
            decode_value(bad, rec.key)
    with pytest.raises(CorruptRecord):
        decode_value(value, b"another key here")  # a value stored under a different key


def test_put_get_many_and_probe_roundtrip(tier: RedisTier, redis_server: RedisServer):
    recs = [record(i) for i in range(5)]
    for rec in recs:
        tier.put(rec)
    assert tier.get(recs[0].key) is not None  # readable before the write-behind has sent it
    assert tier.flush(5)
    assert redis_server.client().exists(PREFIX.encode() + recs[0].key)
    got = tier.get_many([r.key for r in recs])
    assert [payload_of(g) for g in got] == [payload_of(r) for r in recs]  # type: ignore[arg-type]
    assert tier.probe([r.key for r in recs] + [b"x" * 16, recs[0].key]) == 5  # leading run only
    assert recs[2].key in tier and len(tier) == 5
    assert {r.key for r in tier.scan()} == {r.key for r in recs}
    tier.delete(recs[0].key)
    assert tier.get(recs[0].key) is None and tier.flush(5)
    assert not redis_server.client().exists(PREFIX.encode() + recs[0].key)


def test_zstd_values_roundtrip(redis_server: RedisServer):
    tier = make_tier(redis_server, disk_compression="zstd")
    try:
        rec = PageRecord(**{**record(3).__dict__, "payload": torch.zeros(1 << 16, dtype=torch.uint8)})
        tier.put(rec)
        assert tier.flush(5)
        assert redis_server.client().strlen(PREFIX.encode() + rec.key) < 4096  # compressed on the wire
        assert payload_of(tier.get(rec.key)) == bytes(1 << 16)  # type: ignore[arg-type]
    finally:
        tier.close()


def test_corrupt_or_foreign_value_is_a_miss_deleted_counted_and_reported(tier: RedisTier, redis_server: RedisServer):
    rec = record(7)
    tier.put(rec)
    assert tier.flush(5)
    rkey = PREFIX.encode() + rec.key
    value = bytearray(redis_server.client().get(rkey))
    value[-10] ^= 0xFF  # one flipped payload byte
    redis_server.client().set(rkey, bytes(value))
    assert tier.get(rec.key) is None
    assert tier.corrupt_records == 1 and rec.key in tier.take_failed()
    assert tier.flush(5) and not redis_server.client().exists(rkey)  # deleted
    redis_server.client().set(rkey, b"somebody else's value")  # not ours at all
    assert tier.get(rec.key) is None and tier.corrupt_records == 2
    redis_server.client().delete(rkey)
    redis_server.client().rpush(rkey, b"a list")  # wrong Redis type: a miss, not an error
    assert tier.get(rec.key) is None


def test_a_key_redis_evicted_is_reported_lost(tier: RedisTier, redis_server: RedisServer):
    rec = record(9)
    tier.put(rec)
    assert tier.flush(5)
    redis_server.client().flushall()  # what maxmemory eviction or an expired TTL looks like
    assert tier.get(rec.key) is None
    assert tier.take_failed() == [rec.key] and tier.stats()["missing_pages"] == 1
    assert tier.get_many([rec.key], report_missing=False) == [None] and tier.take_failed() == []


def test_ttl_is_set_and_refreshed_on_read(redis_server: RedisServer):
    tier = make_tier(redis_server, redis_ttl_s=100)
    try:
        rec = record(11)
        tier.put(rec)
        assert tier.flush(5)
        rkey = PREFIX.encode() + rec.key
        assert 0 < redis_server.client().ttl(rkey) <= 100
        redis_server.client().expire(rkey, 5)
        assert tier.get(rec.key) is not None and redis_server.client().ttl(rkey) > 5  # GETEX refreshed it
    finally:
        tier.close()


def test_redis_down_at_start_answers_misses_fast_then_reconnects(tmp_path):
    server = RedisServer(tmp_path / "late")
    server.kill()  # nothing listens on the port
    tier = make_tier(server)
    try:
        rec = record(1)
        t0 = time.monotonic()
        assert tier.get(rec.key) is None and tier.probe([rec.key]) == 0
        assert time.monotonic() - t0 < 1.0
        assert not tier.available and tier.stats()["errors"] >= 1
        tier.put(rec)  # refused while down: reported lost, never queued
        assert rec.key in tier.take_failed()
        server.start()
        deadline = time.monotonic() + 10
        while tier.probe([b"k" * 16]) == 0 and not tier.available and time.monotonic() < deadline:
            time.sleep(0.05)
        tier.put(rec)
        assert tier.flush(5)
        assert tier.get(rec.key) is not None and tier.stats()["up"] == 1
    finally:
        tier.close()
        server.stop()


def test_paused_redis_never_blocks_beyond_the_timeout(tier: RedisTier, redis_server: RedisServer):
    rec = record(2)
    tier.put(rec)
    assert tier.flush(5)
    redis_server.pause()  # connected, but it answers nothing
    try:
        t0 = time.monotonic()
        assert tier.get(rec.key) is None
        first = time.monotonic() - t0
        t0 = time.monotonic()
        assert tier.get(rec.key) is None  # the breaker is open: no wait at all
        assert first < 0.3 + 0.5 and time.monotonic() - t0 < 0.05
    finally:
        redis_server.resume()
    deadline = time.monotonic() + 10
    while tier.get(rec.key) is None and time.monotonic() < deadline:
        time.sleep(0.05)
    assert tier.get(rec.key) is not None  # reconnected by itself
