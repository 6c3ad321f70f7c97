"""Salts (vLLM's cache_salt): pages stored under a salt are found under that salt only, inside the
tenant that stored them, and they count against that tenant; no registration per salt."""
from __future__ import annotations

import pytest
import torch
from kv_tensors import random_kv

from kvstore import KVStoreError, ModelSpec

SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", page_size=4)
TOKENS = list(range(100, 110))  # two full pages and a tail


def test_a_salted_prefix_hits_under_its_own_salt_only(make_store):
    store = make_store()
    store.register_model("m", SPEC)
    kv = random_kv(SPEC, 10, seed=1)
    assert store.store("m", TOKENS, kv, salt="s1").stored_tokens == 10

    assert store.lookup("m", TOKENS, salt="s1").matched_tokens == 10
    got = store.fetch("m", TOKENS, salt="s1")
    assert got.matched_tokens == 10 and torch.equal(got.kv, kv)
    assert store.lookup("m", TOKENS + [7, 8], salt="s1").matched_tokens == 10  # a prefix of a longer prompt
    for other in (None, "s2", "S1", "s1 "):
        assert store.lookup("m", TOKENS, salt=other).matched_tokens == 0
        assert store.fetch("m", TOKENS, salt=other).matched_tokens == 0


def test_unsalted_pages_are_not_served_to_a_salt_and_two_salts_keep_their_own_kv(make_store):
    store = make_store()
    store.register_model("m", SPEC)
    plain, one, two = (random_kv(SPEC, 10, seed=s) for s in (1, 2, 3))
    store.store("m", TOKENS, plain)
    store.store("m", TOKENS, one, salt="one")
    store.store("m", TOKENS, two, salt="two")
    assert torch.equal(store.fetch("m", TOKENS).kv, plain)
    assert torch.equal(store.fetch("m", TOKENS, salt="one").kv, one)
    assert torch.equal(store.fetch("m", TOKENS, salt="two").kv, two)
    assert store.stats()["tiers"]["cpu"]["pages"] == 9  # three trees of three pages: nothing shared


def test_a_salt_extends_its_own_prefix_from_start(make_store):
    store = make_store()
    store.register_model("m", SPEC)
    kv = random_kv(SPEC, 10, seed=4)
    store.store("m", TOKENS[:8], kv[:, :, :8], salt="s")
    assert store.store("m", TOKENS, kv[:, :, 8:], start=8, salt="s").stored_tokens == 10
    assert torch.equal(store.fetch("m", TOKENS, start=4, salt="s").kv, kv[:, :, 4:])
    # Without the head under this salt, a store from `start` has nothing to extend.
    assert store.store("m", TOKENS, kv[:, :, 8:], start=8, salt="other").stored_tokens == 0


def test_salted_pages_count_against_their_tenant_and_stay_apart_from_other_tenants(make_store):
    store = make_store(cpu_bytes=SPEC.page_bytes * 64, data_dir=None, disk_bytes=0)
    store.register_model("m", SPEC, tenant="a")
    store.register_model("m", SPEC, tenant="b")
    store.store("m", TOKENS, random_kv(SPEC, 10, seed=5), tenant="a", salt="s")
    assert store.lookup("m", TOKENS, tenant="b", salt="s").matched_tokens == 0  # same salt, other tenant
    assert store.lookup("m", TOKENS, tenant="a", salt="s").matched_tokens == 10
    tenants = store.stats()["tenants"]
    assert tenants["a"]["bytes"]["cpu"] > 0 and tenants.get("b", {}).get("bytes", {}).get("cpu", 0) == 0


def test_a_tenants_quota_takes_room_from_its_salted_pages(make_store):
    store = make_store(cpu_bytes=SPEC.page_bytes * 64, data_dir=None, disk_bytes=0)
    store.register_model("m", SPEC, tenant="a")
    store.store("m", TOKENS[:8], random_kv(SPEC, 8, seed=6), tenant="a")
    page_bytes = store.stats()["tenants"]["a"]["bytes"]["cpu"] // 2
    store.set_tenant_quota("a", 6 * page_bytes)
    for i in range(20):  # a new salt per conversation: ten times the quota in all
        toks = [i * 100 + t for t in range(8)]
        assert store.store("m", toks, random_kv(SPEC, 8, seed=i), tenant="a", salt=f"conv-{i}").stored_tokens == 8
        assert store.stats()["tenants"]["a"]["bytes"]["cpu"] <= 6 * page_bytes
    assert store.lookup("m", [19 * 100 + t for t in range(8)], tenant="a", salt="conv-19").matched_tokens == 8


def test_salted_pages_survive_a_restart_from_disk(make_store):
    store = make_store(cpu_bytes=0)  # disk alone: every page is a record
    store.register_model("m", SPEC)
    kv = random_kv(SPEC, 10, seed=7)
    store.store("m", TOKENS, kv, salt="s1")
    store.close()
    store = make_store(cpu_bytes=0)
    assert store.lookup("m", TOKENS).matched_tokens == 0
    got = store.fetch("m", TOKENS, salt="s1")
    assert got.matched_tokens == 10 and torch.equal(got.kv, kv)


def test_dropping_a_model_drops_its_salted_pages(make_store):
    store = make_store()
    store.register_model("m", SPEC)
    store.store("m", TOKENS, random_kv(SPEC, 10, seed=8), salt="s1")
    store.drop_model("m")
    store.register_model("m", SPEC)
    assert store.lookup("m", TOKENS, salt="s1").matched_tokens == 0
    assert store.stats()["tiers"]["cpu"]["pages"] == 0


def test_chunks_and_blends_are_salted_too(make_store):
    spec = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", page_size=4)
    store = make_store()
    store.register_model("m", spec)
    chunk = list(range(40, 48))
    kv = random_kv(spec, 8, seed=9)
    store.store_chunk("m", chunk, kv, salt="s")
    assert store.blend("m", [chunk], salt="s").hits == [True]
    assert store.blend("m", [chunk]).hits == [False]
    assert store.blend("m", [chunk], salt="t").hits == [False]


@pytest.mark.parametrize("salt", ["", 7, b"s", ["s"], "x" * 1025, "\udc80", "é" * 513])
def test_a_bad_salt_is_refused_by_name_and_stores_nothing(make_store, salt):
    store = make_store()
    store.register_model("m", SPEC)
    kv = random_kv(SPEC, 10, seed=10)
    for call in (lambda: store.store("m", TOKENS, kv, salt=salt), lambda: store.lookup("m", TOKENS, salt=salt),
                 lambda: store.fetch("m", TOKENS, salt=salt)):
        with pytest.raises(KVStoreError) as err:
            call()
        assert err.value.field == "salt" and "salt" in str(err.value)
    assert store.stats()["tiers"]["cpu"]["pages"] == 0


def test_the_longest_salt_allowed_works(make_store):
    store = make_store()
    store.register_model("m", SPEC)
    salt = "é" * 512  # 1024 bytes of UTF-8
    store.store("m", TOKENS, random_kv(SPEC, 10, seed=11), salt=salt)
    assert store.lookup("m", TOKENS, salt=salt).matched_tokens == 10
