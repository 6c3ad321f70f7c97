"""Per-tenant quotas: a tenant with max_bytes makes room from its own pages, never from others'."""
from __future__ import annotations

import pytest
import torch
from kv_tensors import random_kv

from kvstore import ModelSpec

SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", page_size=4)


def seq(i: int) -> list[int]:
    return [i * 1000 + t for t in range(8)]  # two full pages


def page_bytes(store) -> int:
    tier = store.stats()["tiers"]["cpu"]
    return tier["bytes"] // tier["pages"]


@pytest.mark.parametrize("disk_bytes", [0, 1 << 20])
def test_quota_tenant_evicts_only_its_own_pages(make_store, disk_bytes):
    store = make_store(cpu_bytes=SPEC.page_bytes * 16, disk_bytes=disk_bytes,
                       **({} if disk_bytes else {"data_dir": None}))
    for tenant in ("a", "b"):
        store.register_model("m", SPEC, tenant=tenant)
    kvs = {i: random_kv(SPEC, 8, seed=i) for i in range(40)}
    for i in range(3):  # b: 6 pages, no quota
        store.store("m", seq(i), kvs[i], tenant="b")
    quota = 4 * page_bytes(store)
    store.set_tenant_quota("a", quota)
    for i in range(3, 40):  # a stores ten times its quota
        assert store.store("m", seq(i), kvs[i], tenant="a").stored_tokens == 8
        assert store.stats()["tenants"]["a"]["bytes"]["cpu"] <= quota
    for i in range(3):  # b's pages are all still in memory
        assert store.lookup("m", seq(i), tenant="b").tiers == {"cpu": 8}
    for i in (38, 39):  # a's most recent are served from memory, exactly
        assert store.lookup("m", seq(i), tenant="a").tiers == {"cpu": 8}
        assert torch.equal(store.fetch("m", seq(i), tenant="a").kv, kvs[i])
    if disk_bytes:  # a's older pages went down to disk, not away
        assert store.lookup("m", seq(3), tenant="a").tiers == {"disk": 8}
    stats = store.stats()
    assert stats["tenants"]["a"] == {"max_bytes": quota, "bytes": {"cpu": quota}}
    assert stats["tenants"]["b"] == {"max_bytes": None, "bytes": {"cpu": 6 * page_bytes(store)}}
    assert stats["tiers"]["cpu"]["bytes"] <= stats["tiers"]["cpu"]["capacity_bytes"]


def test_tenant_without_quota_is_unaffected(make_store):
    """c has no quota: it fills the whole tier and evicts anyone, in LRU order, as without quotas."""
    store = make_store(cpu_bytes=SPEC.page_bytes * 8, disk_bytes=0, data_dir=None)
    for tenant in ("a", "b", "c"):
        store.register_model("m", SPEC, tenant=tenant)
    store.store("m", seq(0), random_kv(SPEC, 8), tenant="b")
    store.set_tenant_quota("a", 2 * page_bytes(store))
    store.store("m", seq(1), random_kv(SPEC, 8), tenant="a")
    for i in range(2, 6):  # 8 pages: the whole tier
        store.store("m", seq(i), random_kv(SPEC, 8), tenant="c")
    assert all(store.lookup("m", seq(i), tenant="c").matched_tokens == 8 for i in range(2, 6))
    assert store.lookup("m", seq(0), tenant="b").matched_tokens == 0
    assert store.lookup("m", seq(1), tenant="a").matched_tokens == 0
    assert store.stats()["tenants"]["c"]["bytes"]["cpu"] == store.stats()["tiers"]["cpu"]["capacity_bytes"]


def test_quota_caps_one_long_store_and_can_be_lifted(make_store):
    store = make_store(cpu_bytes=SPEC.page_bytes * 16, disk_bytes=0, data_dir=None)
    store.register_model("m", SPEC, tenant="a")
    store.store("m", [1, 2, 3, 4], random_kv(SPEC, 4), tenant="a")
    one = page_bytes(store)
    store.set_tenant_quota("a", 3 * one)  # the page already held counts
    tokens = list(range(100, 140))  # 10 pages, pinned together while stored: only 3 fit
    kv = random_kv(SPEC, 40, seed=1)
    assert store.store("m", tokens, kv, tenant="a").stored_tokens == 12
    assert torch.equal(store.fetch("m", tokens, tenant="a").kv, kv[:, :, :12])
    assert store.stats()["tenants"]["a"]["bytes"]["cpu"] == 3 * one
    store.set_tenant_quota("a", None)
    assert store.store("m", tokens, kv, tenant="a").stored_tokens == 40
    with pytest.raises(ValueError, match="max_bytes"):
        store.set_tenant_quota("a", -1)


def test_random_mix_keeps_accounts_and_quotas(make_store):
    """Stores, extensions, fetches (promotions from disk) and drops of three tenants: each memory
    tier's bytes are exactly the tenants' bytes, quotas hold, and whatever is served is exact."""
    import random
    rng = random.Random(7)
    store = make_store(cpu_bytes=SPEC.page_bytes * 12, disk_bytes=1 << 20)
    tenants = ("a", "b", "c")
    for tenant in tenants:
        store.register_model("m", SPEC, tenant=tenant)
    store.store("m", [1, 2, 3, 4], random_kv(SPEC, 4), tenant="c")
    quotas = {"a": 3 * page_bytes(store), "b": 5 * page_bytes(store)}
    for tenant, quota in quotas.items():
        store.set_tenant_quota(tenant, quota)
    kv = random_kv(SPEC, 64, seed=3)
    for step in range(300):
        tenant, n = rng.choice(tenants), rng.randrange(1, 25)
        tokens = [rng.randrange(3) * 100 + t for t in range(n)]  # shared prefixes, ragged tails
        action = rng.random()
        if action < 0.5:
            store.store("m", tokens, kv[:, :, :n], tenant=tenant)
        elif action < 0.97:
            got = store.fetch("m", tokens, tenant=tenant)
            assert torch.equal(got.kv, kv[:, :, :got.matched_tokens])
        else:
            store.drop_model("m", tenant=tenant)
            store.register_model("m", SPEC, tenant=tenant)
        stats = store.stats()
        held = sum(t["bytes"].get("cpu", 0) for t in stats["tenants"].values())
        assert held == stats["tiers"]["cpu"]["bytes"], step
        for tenant, quota in quotas.items():
            assert stats["tenants"][tenant]["bytes"].get("cpu", 0) <= quota, step


def test_a_quota_set_while_learning_later_learns_later_too(make_store):
    # The sidecar turns learn_later on before any quota exists; a tenant's own policy made
    # afterwards must hold its learning as the tier's does, and hand it back on learn_later(False).
    store = make_store()
    store.learn_later()
    store.set_tenant_quota("a", 1 << 20)
    own = store._placement.tenant_policies[("cpu", "a")]
    assert own.pending == []
    store.learn_later(False)
    assert own.pending is None and store._placement.policies["cpu"].pending is None


@pytest.mark.parametrize("policy", ["lru", "lru-tail", "duel"])
def test_a_fetch_keeps_a_quota_tenants_page_in_its_own_ranking(make_store, policy):
    # A fetch touches its pages in the tier's ranking and in the tenant's own: the tenant's
    # oldest page, once fetched, outlives the newer one it did not fetch (`lru` ranks a page
    # again on its touch; the leaf-first policies read its last access when it surfaces).
    store = make_store(cpu_bytes=SPEC.page_bytes * 16, disk_bytes=0, data_dir=None, policy=policy)
    store.register_model("m", SPEC, tenant="a")
    store.store("m", seq(0), random_kv(SPEC, 8, seed=0), tenant="a")
    store.set_tenant_quota("a", 4 * page_bytes(store))  # two sequences
    store.store("m", seq(1), random_kv(SPEC, 8, seed=1), tenant="a")
    got = store.fetch("m", seq(0), tenant="a")
    assert got.matched_tokens == 8 and torch.equal(got.kv, random_kv(SPEC, 8, seed=0))
    assert store.store("m", seq(2), random_kv(SPEC, 8, seed=2), tenant="a").stored_tokens == 8
    assert store.lookup("m", seq(0), tenant="a").matched_tokens == 8
    assert store.lookup("m", seq(1), tenant="a").matched_tokens == 0
    assert torch.equal(store.fetch("m", seq(0), tenant="a").kv, random_kv(SPEC, 8, seed=0))
