"""Payloads received straight into the fetch answer (tiers/redis_landing.py): what a user fetches
from Redis is bit-exact for every dtype and any start, into a buffer of the caller's or not; a
page whose header or payload is corrupt, whose value is truncated or foreign, is a miss and the
pages before it are still served, although its bytes went into the answer's buffer; compressed
records, records the caller does not accept and sockets without recvmsg_into (TLS) are received
into a fresh buffer as before."""
from __future__ import annotations

import socket
import threading

import numpy as np
import pytest
import redis
import torch
import xxhash
from redis_helpers import RedisServer
from test_redis_tier import PREFIX as TIER_PREFIX
from test_redis_tier import make_tier, payload_of, record

import kvstore.tier_stack
from kvstore import KVStore, ModelSpec, StoreConfig
from kvstore.keys import namespace_key, prefix_keys, tokens_bytes
from kvstore.tiers.base import PageRecord
from kvstore.tiers.redis_landing import Landing, receive_record
from kvstore.tiers.redis_reader import ReplyReader
from kvstore.tiers.redis_record import encode_value

PREFIX = "land:"
BITS = {torch.float16: torch.int16, torch.bfloat16: torch.int16, torch.float32: torch.int32}  # same-width ints


def big_spec(dtype: str) -> ModelSpec:
    # 16 tokens x 8 heads x 64 dims: each (layer, K/V) slice of a page is 16 or 32 KiB, a page
    # 128 or 256 KiB, so one page spans several socket reads and the reply-header buffer.
    return ModelSpec(num_layers=4, num_kv_heads=8, head_dim=64, dtype=dtype, page_size=16)


def any_bits(spec: ModelSpec, num_tokens: int, seed: int) -> torch.Tensor:
    """KV whose bits are uniformly random (NaN payloads, infinities, subnormals, signed zeros)."""
    bits = BITS[getattr(torch, spec.dtype)]
    info = torch.iinfo(bits)
    raw = torch.randint(info.min, info.max, spec.kv_shape(num_tokens), dtype=bits,
                        generator=torch.Generator().manual_seed(seed))  # (L, 2, T, H, D)
    return raw.view(getattr(torch, spec.dtype))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(BITS[a.dtype]), b.view(BITS[b.dtype]))


def redis_only(server: RedisServer, **overrides) -> KVStore:
    fields = {"data_dir": None, "cpu_bytes": 0, "disk_bytes": 0, "redis_url": server.url,
              "redis_key_prefix": PREFIX, "redis_timeout_s": 5}
    fields.update(overrides)
    return KVStore(StoreConfig(**fields))


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_fetches_from_redis_are_bit_exact_for_every_dtype_and_start(redis_server: RedisServer, dtype, monkeypatch):
    spec = big_spec(dtype)
    monkeypatch.setattr(kvstore.tier_stack, "READ_BATCH_BYTES", 2 * spec.page_bytes)  # batches in flight
    tokens, kv = list(range(87)), any_bits(spec, 87, seed=1)  # five full pages and a 7-token tail
    with redis_only(redis_server) as store:
        store.register_model("m", spec)
        store.store("m", tokens, kv)
        assert store.flush(5)
        into = torch.full((87 * spec.bytes_per_token,), 0xAB, dtype=torch.uint8)
        for start in (0, 1, 16, 40, 80, 86):
            fetched = store.fetch("m", tokens, start=start)
            assert fetched.matched_tokens == 87 and same_bits(fetched.kv, kv[:, :, start:])
            fetched = store.fetch("m", tokens, start=start, into=into)
            assert fetched.kv.data_ptr() == into.data_ptr()  # the answer is in the caller's buffer ...
            assert fetched.matched_tokens == 87 and same_bits(fetched.kv, kv[:, :, start:])  # ... bit-exact
        fetched = store.fetch("m", tokens[:70])  # the last page matched in part
        assert fetched.matched_tokens == 70 and same_bits(fetched.kv, kv[:, :, :70])
        assert store.stats()["corrupt_records"] == 0 and store.stats()["tiers"]["redis"]["errors"] == 0


def forged(spec: ModelSpec, key: bytes, parent: bytes, kv: torch.Tensor) -> bytes:
    """A valid record stored under `key` for other token ids (what a hash collision looks like)."""
    return encode_value(PageRecord(namespace=namespace_key("m", spec.fingerprint), key=key, parent=parent,
                                   tokens=tokens_bytes(range(7, 7 + spec.page_size)), codec="none", dtype=spec.dtype,
                                   shape=spec.kv_shape(spec.page_size), payload=kv.view(torch.uint8).flatten()), None)


@pytest.mark.parametrize("damage", ["payload", "header", "truncated", "foreign", "collision"])
def test_a_bad_page_ends_the_answer_and_the_pages_before_it_are_served(redis_server: RedisServer, damage):
    spec = big_spec("bfloat16")
    tokens, kv = list(range(80)), any_bits(spec, 80, seed=2)  # five pages; page 2 (tokens 32-47) goes bad
    with redis_only(redis_server) as store:
        store.register_model("m", spec)
        store.store("m", tokens, kv)
        assert store.flush(5)
        keys = [PREFIX.encode() + k for k in prefix_keys(namespace_key("m", spec.fingerprint), tokens, spec.page_size)]
        r = redis_server.client()
        value = bytearray(r.get(keys[2]))
        if damage == "payload":
            value[-1] ^= 0x01  # the page's last byte: every other byte arrives intact
        elif damage == "header":
            value[6] ^= 0x01
        elif damage == "truncated":
            value = value[:-100]
        elif damage == "foreign":
            value = bytearray(r.get(keys[3]))  # another page's intact value
        else:
            value = bytearray(forged(spec, keys[2][len(PREFIX):], keys[1][len(PREFIX):], any_bits(spec, 16, seed=5)))
        r.set(keys[2], bytes(value))
        into = torch.full((80 * spec.bytes_per_token,), 0xAB, dtype=torch.uint8)
        fetched = store.fetch("m", tokens, into=into)
        assert fetched.matched_tokens == 32 and same_bits(fetched.kv, kv[:, :, :32])
        # (L, 2, 16, H, D)
        region = into.view(torch.bfloat16).view(spec.kv_shape(80))[:, :, 32:48].contiguous().view(torch.uint8)
        if damage == "payload":  # the lost page's bytes went into the caller's buffer, past the answer
            assert int((region != kv[:, :, 32:48].contiguous().view(torch.uint8)).sum()) == 1
        elif damage == "collision":  # declined on its header: nothing was received there
            assert bool((region == 0xAB).all())
        assert store.stats()["corrupt_records"] == (0 if damage == "collision" else 1)
        assert store.lookup("m", tokens).matched_tokens == 32  # the bad copy is forgotten ...
        assert store.flush(5) and not r.exists(keys[2])  # ... and deleted
        fetched = store.fetch("m", tokens)
        assert fetched.matched_tokens == 32 and same_bits(fetched.kv, kv[:, :, :32])


def test_compressed_records_are_fetched_bit_exact(redis_server: RedisServer):
    spec = big_spec("float16")
    tokens = list(range(40))
    kv = torch.zeros(spec.kv_shape(40), dtype=torch.float16)  # (L, 2, T, H, D), compressible ...
    kv[:, :, ::3] = any_bits(spec, 40, seed=3)[:, :, ::3]  # ... but not constant
    with redis_only(redis_server, disk_compression="zstd") as store:
        store.register_model("m", spec)
        store.store("m", tokens, kv)
        assert store.flush(5)
        for start in (0, 20):
            fetched = store.fetch("m", tokens, start=start)
            assert fetched.matched_tokens == 40 and same_bits(fetched.kv, kv[:, :, start:])


def test_the_tier_lands_a_payload_only_where_the_caller_accepts_its_header(redis_server: RedisServer):
    tier = make_tier(redis_server)
    try:
        recs = [record(i, nbytes=1 << 17) for i in range(4)]
        for rec in recs:
            tier.put(rec)
        assert tier.flush(5)
        buffers = [torch.full((1 << 17,), 7, dtype=torch.uint8) for _ in recs]
        views = [memoryview(b.numpy()) for b in buffers]
        # Landing 0: 8 rows of 16 KiB, every other 16 KiB of a 256 KiB block (strided, as a
        # page's rows are in a fetch answer of several pages); the gaps must stay untouched.
        spaced = np.full((8, 2 << 14), 7, dtype=np.uint8)
        landings = {
            recs[0].key: Landing(spaced[:, :1 << 14], lambda header: header.tokens == recs[0].tokens),
            recs[1].key: Landing(buffers[1].numpy().reshape(1, -1), lambda header: False),  # declined: a fresh buffer
            # too small: a fresh buffer
            recs[2].key: Landing(buffers[2].numpy()[:100].reshape(1, -1), lambda header: True),
        }
        got: dict = {}
        for found in tier.read_ahead([[recs[0].key, recs[1].key], [recs[2].key, recs[3].key]], landings):
            got.update(found)
        assert got[recs[0].key].payload is landings[recs[0].key] and got[recs[0].key].tokens == recs[0].tokens
        assert spaced[:, :1 << 14].tobytes() == payload_of(recs[0]) and bool((spaced[:, 1 << 14:] == 7).all())
        for i in (1, 2, 3):
            assert payload_of(got[recs[i].key]) == payload_of(recs[i])
        assert bytes(views[1]) == bytes(views[2]) == b"\7" * (1 << 17)  # untouched
        # A corrupt payload received into a landing is a miss, deleted and counted.
        rkey = TIER_PREFIX.encode() + recs[0].key
        value = bytearray(redis_server.client().get(rkey))
        value[-5] ^= 0x10
        redis_server.client().set(rkey, bytes(value))
        [found] = tier.read_ahead([[recs[0].key]], {recs[0].key: landings[recs[0].key]})
        assert found == {recs[0].key: None} and tier.corrupt_records == 1 and tier.take_failed() == [recs[0].key]
    finally:
        tier.close()


def test_chunked_bulk_values_arrive_whole_in_order_and_leave_the_stream_in_step():
    payload = torch.randint(0, 256, (300_001,), dtype=torch.uint8,
                            generator=torch.Generator().manual_seed(4)).numpy().tobytes()
    wire = b"$%d\r\n%b\r\n$5\r\nafter\r\n$-1\r\n" % (len(payload), payload)
    ours, theirs = socket.socketpair()

    def send_in_dribbles() -> None:  # uneven pieces: chunks fill across many reads
        pos = 0
        for size in [3, 70_000, 1, 65_536, 5, 100_000] * 10:
            theirs.sendall(wire[pos:pos + size])
            pos += size
            if pos >= len(wire):
                break

    sender = threading.Thread(target=send_in_dribbles)
    sender.start()
    try:
        reader = ReplyReader(ours)
        dest = bytearray(len(payload))
        view = memoryview(dest)
        bounds = [0, 1, 1, 4096, 70_001, 200_000, len(payload)]  # one empty chunk, odd sizes
        chunks = [view[a:b] for a, b in zip(bounds, bounds[1:])]
        digest = xxhash.xxh3_64()
        pieces = []

        def receive(rdr: ReplyReader, nbytes: int) -> str:
            assert nbytes == len(payload)
            rdr.fill_chunks(chunks, lambda piece: (digest.update(piece), pieces.append(bytes(piece))))
            rdr.end_bulk()
            return "landed"

        assert reader.read_value(receive) == "landed"
        assert bytes(dest) == payload and b"".join(pieces) == payload
        assert digest.intdigest() == xxhash.xxh3_64_intdigest(payload)
        assert bytes(reader.read_value().numpy()) == b"after" and reader.read_value() is None and reader.drained
    finally:
        sender.join()
        ours.close()
        theirs.close()


def test_a_value_cut_short_by_a_closed_connection_is_an_error_not_a_value():
    ours, theirs = socket.socketpair()
    theirs.sendall(b"$1000\r\n" + b"x" * 600)
    theirs.close()
    reader = ReplyReader(ours)
    dest = memoryview(bytearray(1000))
    try:
        with pytest.raises(redis.exceptions.ConnectionError):
            reader.read_value(lambda rdr, nbytes: rdr.fill_chunks([dest[:500], dest[500:]], lambda piece: None))
    finally:
        ours.close()


class RecvIntoOnly:
    """A socket as a TLS one looks to the reader: no recvmsg_into."""

    def __init__(self, sock: socket.socket) -> None:
        self.recv_into = sock.recv_into


def test_a_socket_without_recvmsg_into_receives_the_whole_value_into_a_fresh_buffer():
    rec = record(5, nbytes=1 << 16)
    value = encode_value(rec, None)
    ours, theirs = socket.socketpair()
    theirs.sendall(b"$%d\r\n%b\r\n" % (len(value), value))
    dest = torch.full((1 << 16,), 7, dtype=torch.uint8)
    landing = Landing(dest.numpy().reshape(1, -1), lambda header: True)
    try:
        reader = ReplyReader(RecvIntoOnly(ours))
        got = reader.read_value(lambda rdr, nbytes: receive_record(rdr, nbytes, rec.key, landing))
        assert isinstance(got, torch.Tensor) and bytes(got.numpy()) == value and reader.drained
        assert bool((dest == 7).all())  # nothing landed
    finally:
        ours.close()
        theirs.close()
