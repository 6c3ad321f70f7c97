"""Two in-process stores (separate data dirs, one Redis) behave as two sidecars sharing pages:
what one stores the other finds, fetches bit-exact and promotes; namespaces and tenants hold;
corrupt, forged and evicted pages are misses; pages demoted from a full CPU tier land in Redis."""
from __future__ import annotations

import time
from typing import Callable

import torch
from kv_tensors import random_kv
from redis_helpers import RedisServer

import kvstore.tier_stack
from kvstore import KVStore, ModelSpec
from kvstore.keys import namespace_key, prefix_keys
from kvstore.tiers.base import PageRecord
from kvstore.tiers.redis_record import encode_value

PREFIX = b"kvstore:"


def pair(make: Callable[..., KVStore], spec: ModelSpec, **overrides) -> tuple[KVStore, KVStore]:
    a, b = make("a", **overrides), make("b", **overrides)
    for store in (a, b):
        store.register_model("m", spec)
    return a, b


def test_pages_stored_through_one_store_are_found_fetched_and_promoted_by_another(make_sidecar_store, spec):
    a, b = pair(make_sidecar_store, spec)
    tokens, kv = list(range(100, 110)), random_kv(spec, 10)
    assert a.store("m", tokens, kv).new_pages == 3
    assert a.flush(5)
    assert b.lookup("m", tokens).tiers == {"redis": 10}
    fetched = b.fetch("m", tokens)
    assert fetched.matched_tokens == 10 and torch.equal(fetched.kv, kv)
    assert b.lookup("m", tokens).tiers == {"cpu": 10}  # promoted into B's own top tier
    # B never looked this one up: fetch probes Redis itself; `start` slices as locally.
    tokens2, kv2 = list(range(500, 516)), random_kv(spec, 16, seed=2)
    a.store("m", tokens2, kv2)
    assert a.flush(5)
    fetched = b.fetch("m", tokens2 + [1, 2], start=5)
    assert fetched.matched_tokens == 16 and torch.equal(fetched.kv, kv2[:, :, 5:])
    stats = b.stats()["tiers"]["redis"]
    assert stats["hits"] == 6 and stats["up"] == 1 and stats["errors"] == 0


def test_a_longer_prompt_reuses_the_shared_full_pages_past_the_local_match(make_sidecar_store, spec):
    a, b = pair(make_sidecar_store, spec)
    tokens, kv = list(range(100, 116)), random_kv(spec, 16)
    a.store("m", tokens, kv)
    assert a.flush(5)
    b.store("m", tokens[:4], kv[:, :, :4])  # B holds the first page itself
    found = b.lookup("m", tokens + [7, 7, 7])
    assert found.matched_tokens == 16 and found.tiers == {"cpu": 4, "redis": 12}
    assert torch.equal(b.fetch("m", tokens + [7]).kv, kv)


def test_namespaces_and_tenants_hold_across_stores(make_sidecar_store, spec):
    a, b = pair(make_sidecar_store, spec)
    other_spec = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4, rope_theta=5e5)
    for store in (a, b):
        store.register_model("m", spec, tenant="alice")
        store.register_model("m", spec, tenant="bob")
        store.register_model("m2", spec)
    b.register_model("m3", other_spec)
    tokens, kv = list(range(8)), random_kv(spec, 8)
    a.store("m", tokens, kv, tenant="alice")
    assert a.flush(5)
    assert b.lookup("m", tokens, tenant="bob").matched_tokens == 0
    assert b.lookup("m", tokens).matched_tokens == 0  # no tenant is a tenant of its own
    assert b.lookup("m2", tokens).matched_tokens == 0  # another model name
    assert b.lookup("m3", tokens).matched_tokens == 0  # another spec
    assert b.fetch("m", tokens, tenant="bob").matched_tokens == 0
    assert torch.equal(b.fetch("m", tokens, tenant="alice").kv, kv)


def test_pages_evicted_from_the_cpu_tier_are_served_from_redis(make_sidecar_store, spec):
    store = make_sidecar_store("solo", cpu_bytes=16 << 10, disk_bytes=0)
    store.register_model("m", spec)
    prompts = [(list(range(i * 100, i * 100 + 32)), random_kv(spec, 32, seed=i)) for i in range(12)]
    for tokens, kv in prompts:
        store.store("m", tokens, kv)
    assert store.flush(5)
    assert store.stats()["tiers"]["cpu"]["evictions"] > 0
    tokens, kv = prompts[0]
    assert "redis" in store.lookup("m", tokens).tiers
    assert torch.equal(store.fetch("m", tokens).kv, kv)


def test_redis_as_the_only_tier(make_sidecar_store, spec):
    store = make_sidecar_store("only", cpu_bytes=0, disk_bytes=0, data_dir=None)
    store.register_model("m", spec)
    tokens, kv = list(range(9)), random_kv(spec, 9)
    assert store.store("m", tokens, kv).stored_tokens == 9
    assert store.lookup("m", tokens).tiers == {"redis": 9}
    assert torch.equal(store.fetch("m", tokens).kv, kv)


def test_corrupt_forged_and_evicted_shared_pages_are_misses(make_sidecar_store, spec, redis_server: RedisServer):
    a, b = pair(make_sidecar_store, spec)
    tokens, kv = list(range(40, 52)), random_kv(spec, 12)
    a.store("m", tokens, kv)
    assert a.flush(5)
    keys = prefix_keys(namespace_key("m", spec.fingerprint), tokens, spec.page_size)
    r = redis_server.client()
    # Page 2: flip a payload byte. B serves page 1 only, and counts and deletes page 2.
    value = bytearray(r.get(PREFIX + keys[1]))
    value[-1] ^= 0x55
    r.set(PREFIX + keys[1], bytes(value))
    fetched = b.fetch("m", tokens)
    assert fetched.matched_tokens == 4 and torch.equal(fetched.kv, kv[:, :, :4])
    assert b.stats()["corrupt_records"] == 1
    assert b.flush(5) and not r.exists(PREFIX + keys[1])
    # Page 1 forged: a valid record under the right key but for other tokens (a collision).
    forged = PageRecord(namespace=namespace_key("m", spec.fingerprint), key=keys[0],
                        parent=namespace_key("m", spec.fingerprint),
                        tokens=torch.tensor([9, 9, 9, 9], dtype=torch.int32).numpy().tobytes(),
                        codec="none", dtype="float16", shape=spec.kv_shape(4),
                        payload=random_kv(spec, 4, seed=9).view(torch.uint8).flatten())
    r.set(PREFIX + keys[0], encode_value(forged, None))
    c = make_sidecar_store("c")
    c.register_model("m", spec)
    assert c.fetch("m", tokens).matched_tokens == 0
    # Evicted by Redis (maxmemory, TTL, FLUSHALL): a miss; the copy is forgotten.
    a.store("m", list(range(900, 908)), random_kv(spec, 8))
    assert a.flush(5)
    assert b.lookup("m", list(range(900, 908))).tiers == {"redis": 8}
    r.flushall()
    assert b.fetch("m", list(range(900, 908))).matched_tokens == 0
    assert b.lookup("m", list(range(900, 908))).matched_tokens == 0


def test_drop_model_deletes_its_pages_from_redis(make_sidecar_store, spec, redis_server: RedisServer):
    a, b = pair(make_sidecar_store, spec)
    tokens = list(range(12))
    a.store("m", tokens, random_kv(spec, 12))
    assert a.flush(5) and redis_server.client().dbsize() == 3
    a.drop_model("m")
    assert a.flush(5) and redis_server.client().dbsize() == 0
    assert b.lookup("m", tokens).matched_tokens == 0


def test_redis_killed_mid_run_local_tiers_keep_serving_then_sharing_resumes(make_sidecar_store, spec,
                                                                            redis_server: RedisServer):
    a, b = pair(make_sidecar_store, spec, redis_timeout_s=0.3)
    tokens, kv = list(range(60, 68)), random_kv(spec, 8)
    a.store("m", tokens, kv)
    assert a.flush(5)
    assert torch.equal(b.fetch("m", tokens).kv, kv)  # B holds it locally now
    redis_server.kill()
    t0 = time.monotonic()
    assert torch.equal(a.fetch("m", tokens).kv, kv) and torch.equal(b.fetch("m", tokens).kv, kv)
    new, new_kv = list(range(70, 78)), random_kv(spec, 8, seed=3)
    assert a.store("m", new, new_kv).stored_tokens == 8  # stored locally; the Redis copy is lost
    assert b.lookup("m", new).matched_tokens == 0 and b.fetch("m", new).matched_tokens == 0
    assert time.monotonic() - t0 < 2.0  # nobody waited on the dead Redis beyond its timeout
    # A's write of `new` to Redis fails in its background writer: "up" drops once it has tried.
    down_by = time.monotonic() + 3
    while a.stats()["tiers"]["redis"]["up"] and time.monotonic() < down_by:
        time.sleep(0.05)
    assert a.stats()["tiers"]["redis"]["up"] == 0
    redis_server.start()  # empty: no persistence
    deadline = time.monotonic() + 10
    later, later_kv = list(range(80, 88)), random_kv(spec, 8, seed=4)
    while time.monotonic() < deadline:
        a.store("m", later, later_kv)
        a.flush(5)
        if b.lookup("m", later).matched_tokens == 8:
            break
        a.drop_model("m")
        a.register_model("m", spec)
        time.sleep(0.1)
    assert b.lookup("m", later).tiers == {"redis": 8}
    assert torch.equal(b.fetch("m", later).kv, later_kv)


def test_a_long_prompt_read_from_redis_in_pipelined_batches_is_bit_exact(make_sidecar_store, spec, monkeypatch):
    monkeypatch.setattr(kvstore.tier_stack, "READ_BATCH_BYTES", 3 * spec.page_bytes)  # several batches in flight
    a, b = pair(make_sidecar_store, spec, cpu_bytes=0, disk_bytes=0, data_dir=None)
    tokens, kv = list(range(1000, 1082)), random_kv(spec, 82, seed=3)  # 20 full pages and a tail
    assert a.store("m", tokens, kv).new_pages == 21
    assert a.flush(5)
    for start in (0, 1, 41, 80):
        fetched = b.fetch("m", tokens, start=start)
        assert fetched.matched_tokens == 82 and torch.equal(fetched.kv, kv[:, :, start:])
    assert b.stats()["tiers"]["redis"]["errors"] == 0
