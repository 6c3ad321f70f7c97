"""The Redis read path's fast steps keep their guarantees: the GETs it packs itself are the
bytes redis-py would send; a value received as a tensor decodes bit-exact, and a truncated,
corrupted or foreign one is still rejected; KV whose bits are NaN payloads, signed zeros or
subnormals comes back bit-exact through a Redis-only store, whatever the header's length; a
prompt held in part still finds the rest in Redis, and one held in full is fetched whole."""
from __future__ import annotations

import pytest
import redis
import torch
from redis_helpers import RedisServer
from test_redis_tier import record

from kvstore import KVStore, ModelSpec, StoreConfig
from kvstore.host_copy import copy_into
from kvstore.tiers.disk_record import CorruptRecord
from kvstore.tiers.redis_reader import pack_gets
from kvstore.tiers.redis_record import decode_value, encode_value


@pytest.mark.parametrize("ttl_s", [None, 7, 86400])
def test_packed_gets_are_the_bytes_redis_py_sends(ttl_s):
    keys = [b"p:" + bytes([i]) * (1 + i) for i in range(5)] + [b"", b"\r\n$*"]
    conn = redis.Redis().connection_pool.make_connection()  # packs only; never connects
    commands = [("GETEX", k, "EX", ttl_s) for k in keys] if ttl_s else [("GET", k) for k in keys]
    assert pack_gets(keys, ttl_s) == b"".join(conn.pack_commands(commands))


def as_tensor(value: bytes) -> torch.Tensor:
    return torch.tensor(list(value), dtype=torch.uint8)  # (value bytes,), as the reader gives


def test_a_tensor_value_decodes_bit_exact_and_bad_ones_are_rejected():
    rec = record(3, nbytes=1 << 16)
    value = encode_value(rec, None)
    back = decode_value(as_tensor(value), rec.key)
    assert bytes(back.payload) == rec.payload.numpy().tobytes()
    header_end = 4 + int.from_bytes(value[:4], "little")
    flipped_header = value[:header_end - 1] + bytes([value[header_end - 1] ^ 1]) + value[header_end:]
    flipped_payload = value[:-100] + bytes([value[-100] ^ 0x80]) + value[-99:]
    for bad in (b"", b"\1\0", value[:header_end], value[:-1], value + b"\0", flipped_header, flipped_payload):
        with pytest.raises(CorruptRecord):
            decode_value(as_tensor(bad), rec.key)
    with pytest.raises(CorruptRecord):
        decode_value(as_tensor(value), b"another key here")


@pytest.mark.parametrize("dtype,bits", [("float16", torch.int16), ("bfloat16", torch.int16), ("float32", torch.int32)])
def test_any_bit_pattern_comes_back_bit_exact_from_a_redis_only_store(redis_server: RedisServer, dtype, bits):
    spec = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype, page_size=4)
    info = torch.iinfo(bits)
    gen = torch.Generator().manual_seed(5)
    raw = torch.randint(info.min, info.max, spec.kv_shape(10), dtype=bits, generator=gen)  # (L, 2, T, H, D)
    raw.view(-1)[:4] = torch.tensor([-1, 0, 1, info.min], dtype=bits)  # a NaN payload, +0, a subnormal, -0
    kv = raw.view(getattr(torch, dtype))
    config = StoreConfig(data_dir=None, cpu_bytes=0, disk_bytes=0, redis_url=redis_server.url, redis_timeout_s=5)
    with KVStore(config) as store:
        store.register_model("m", spec)
        store.store("m", list(range(10)), kv)
        assert store.flush(5)
        for start in (0, 5):
            fetched = store.fetch("m", list(range(10)), start=start)
            assert fetched.matched_tokens == 10 and torch.equal(fetched.kv.view(bits), raw[:, :, start:])


def test_a_prompt_held_in_part_still_finds_the_rest_in_redis(redis_server: RedisServer, tmp_path, spec):
    def make(name: str) -> KVStore:
        store = KVStore(StoreConfig(data_dir=str(tmp_path / name), cpu_bytes=1 << 20, disk_bytes=0,
                                    redis_url=redis_server.url, redis_timeout_s=5))
        store.register_model("m", spec)
        return store

    with make("a") as a, make("b") as b:
        tokens = list(range(200, 214))  # three full pages and a tail
        kv = torch.randn(spec.kv_shape(14), generator=torch.Generator().manual_seed(1)).half()  # (L, 2, T, H, D)
        a.store("m", tokens, kv)
        assert a.flush(5)
        b.store("m", tokens[:8], kv[:, :, :8])  # B holds the first two pages itself
        assert b.lookup("m", tokens).tiers == {"cpu": 8, "redis": 6}
        assert torch.equal(b.fetch("m", tokens).kv, kv)
        assert b.lookup("m", tokens).tiers == {"cpu": 14}  # promoted: now held in full ...
        b.store("m", [9] + tokens[1:8], kv[:, :, :8])  # ... and a sibling differing in its first token
        assert b.lookup("m", [9] + tokens[1:]).tiers == {"cpu": 8}  # does not borrow the others' pages
        assert torch.equal(b.fetch("m", tokens).kv, kv)


@pytest.mark.parametrize("dtype,bits", [("float16", torch.int16), ("bfloat16", torch.int16), ("float32", torch.int32)])
def test_a_payload_at_an_odd_address_is_copied_bit_exact(dtype, bits):
    # A Redis value's payload starts wherever its header ends, often at an odd address.
    info = torch.iinfo(bits)
    raw = torch.randint(info.min, info.max, (2, 2, 4, 2, 8), dtype=bits, generator=torch.Generator().manual_seed(9))
    buffer = bytearray(1) + bytearray(raw.numpy().tobytes())
    src = torch.frombuffer(memoryview(buffer)[1:], dtype=getattr(torch, dtype)).view(raw.shape)  # (L, 2, T, H, D)
    assert src.data_ptr() % 2 == 1
    out = torch.empty((2, 2, 12, 2, 8), dtype=getattr(torch, dtype))
    copy_into(out[:, :, 4:8], src)
    assert torch.equal(out[:, :, 4:8].view(bits), raw)
