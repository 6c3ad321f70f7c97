"""The Redis tier's GET reader on its own (tiers/redis_reader.py): values come back bit-exact and
in order across pipelined batches whatever their size (empty, smaller than a reply header
buffer, many MiB), missing keys are None and wrong-type keys per-key errors; a connection goes
back to the pool clean, and one whose replies were left unread is never read by a later command.
Through the tier: pipelined multi-page reads decode bit-exact, and a corrupt value among them
is a miss (deleted, counted) while the others are served."""
from __future__ import annotations

import os

import pytest
import redis
import torch
from redis_helpers import RedisServer
from test_redis_tier import PREFIX, make_tier, payload_of, record

from kvstore.tiers.redis import RedisTier
from kvstore.tiers.redis_conn import make_client
from kvstore.tiers.redis_reader import LINE_BUFFER_BYTES, pipelined_gets

SIZES = [0, 1, 5, 2, LINE_BUFFER_BYTES - 7, LINE_BUFFER_BYTES + 3, 3 << 20, 17, 1 << 16]


@pytest.fixture
def client(redis_server: RedisServer):
    c = make_client(redis_server.url, 5)
    yield c
    c.close()


def values_as_bytes(values: list) -> list:
    return [bytes(v.numpy()) if isinstance(v, torch.Tensor) else v for v in values]


@pytest.mark.parametrize("ahead", [1, 2, 3, 50])
def test_pipelined_batches_come_back_in_order_bit_exact(client, ahead: int):
    stored = {b"k%d" % i: os.urandom(n) for i, n in enumerate(SIZES)}
    client.mset(stored)
    client.rpush(b"a list", b"x")
    connections = {c["id"] for c in client.client_list()}
    keys = list(stored)
    batches = [keys[:1], keys[1:4], [], [b"absent", keys[4], b"a list"], keys[5:], keys[:2]]
    got = [values_as_bytes(values) for values in pipelined_gets(client.connection_pool, batches, None, ahead)]
    assert len(got) == len(batches)
    for batch, values in zip(batches, got):
        assert len(values) == len(batch)
        for key, value in zip(batch, values):
            if key == b"absent":
                assert value is None
            elif key == b"a list":
                assert isinstance(value, redis.exceptions.ResponseError) and "WRONGTYPE" in str(value)
            else:
                assert value == stored[key]
    assert client.get(keys[6]) == stored[keys[6]]  # the connection went back clean ...
    # ... and no other was opened. (Only new ids count: a connection someone else closed, such
    # as the server fixture's start-up probe, may leave the list at any moment.)
    assert {c["id"] for c in client.client_list()} - connections == set()


def test_many_small_values_in_one_batch_come_back_bit_exact(client):
    # ~200 KB of replies: several land in one recv, and some headers straddle the read buffer's end.
    stored = {b"s%d" % i: os.urandom(997 + i % 3) for i in range(200)}
    client.mset(stored)
    [values] = list(pipelined_gets(client.connection_pool, [list(stored)], None, 1))
    assert values_as_bytes(values) == list(stored.values())


def test_a_reader_stopped_early_never_leaks_replies_to_the_next_command(client):
    stored = {b"a": os.urandom(1 << 20), b"b": os.urandom(1 << 20), b"c": b"small"}
    client.mset(stored)
    reads = pipelined_gets(client.connection_pool, [[b"a"], [b"b"], [b"c"]], None, 3)
    assert values_as_bytes(next(reads)) == [stored[b"a"]]
    reads.close()  # two replies were still on the wire
    for key, value in stored.items():
        assert client.get(key) == value


def test_ttl_reads_refresh_the_ttl(client):
    client.set(b"t", b"value", ex=5)
    [[value]] = list(pipelined_gets(client.connection_pool, [[b"t"]], 100, 1))
    assert bytes(value.numpy()) == b"value" and client.ttl(b"t") > 5


def test_tier_reads_many_pages_pipelined_and_a_corrupt_one_is_a_miss(tier: RedisTier, redis_server: RedisServer):
    recs = [record(i, nbytes=(1 << 18) if i % 3 else 4096) for i in range(12)]
    for rec in recs:
        tier.put(rec)
    assert tier.flush(5)
    rkey = PREFIX.encode() + recs[5].key
    value = bytearray(redis_server.client().get(rkey))
    value[len(value) // 2] ^= 0x01  # one flipped payload bit, mid-pipeline
    redis_server.client().set(rkey, bytes(value))
    batches = [[r.key for r in recs[i:i + 4]] for i in range(0, 12, 4)]
    got: dict = {}
    for found in tier.read_ahead(batches):
        got.update(found)
    assert list(got) == [r.key for r in recs]
    for i, rec in enumerate(recs):
        if i == 5:
            assert got[rec.key] is None
        else:
            assert payload_of(got[rec.key]) == payload_of(rec) and got[rec.key].tokens == rec.tokens
    assert tier.corrupt_records == 1 and tier.take_failed() == [recs[5].key]
    assert tier.flush(5) and not redis_server.client().exists(rkey)  # deleted
    assert payload_of(tier.get(recs[6].key)) == payload_of(recs[6])  # type: ignore[arg-type]


@pytest.fixture
def tier(redis_server: RedisServer):
    t = make_tier(redis_server)
    yield t
    t.close()
