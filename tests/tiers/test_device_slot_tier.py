"""The tier stack drives a slot tier outside host memory (the GPU's) through the tier interface
alone: slots it reads and writes through `view` and the codecs, never numpy, and demotion through
the tier's own `copy_out`. A stand-in for the GPU tier on the CPU (tests/tiers/off_host_tier.py:
the same interface, and memory the host cannot read in place) runs those paths without CUDA."""
from __future__ import annotations

import pytest
import torch
from kv_tensors import random_kv
from off_host_tier import OffHostTier

import kvstore.tier_stack
from kvstore import KVStore, ModelSpec
from kvstore.codecs import get_codec
from kvstore.tiers.cpu import CPUTier
from kvstore.tiers.disk import DiskTier

SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4)


@pytest.fixture
def make_store(monkeypatch, make_store):
    """tests/conftest.py's stores (closed after the test) on the stand-in, no disk tier, "m" registered."""
    monkeypatch.setattr(kvstore.tier_stack, "TIER_TYPES", (OffHostTier, CPUTier, DiskTier))
    monkeypatch.setattr(OffHostTier, "made", [])

    def make(**fields) -> KVStore:
        store = make_store(**{"disk_bytes": 0, **fields})
        store.register_model("m", SPEC)
        return store

    return make


def test_pages_in_an_off_host_slot_tier_come_back_exact(make_store):
    store = make_store(gpu_bytes=64 * SPEC.page_bytes, cpu_bytes=64 * SPEC.page_bytes)
    tokens = list(range(10, 10 + 5 * SPEC.page_size + 2))  # 5 full pages and a tail
    kv = random_kv(SPEC, len(tokens), seed=1)
    assert store.store("m", tokens, kv).stored_tokens == len(tokens)
    assert store.lookup("m", tokens).tiers == {"gpu": len(tokens)}
    for start in (0, 1, SPEC.page_size, len(tokens) - 1):
        got = store.fetch("m", tokens, start=start)
        assert got.matched_tokens == len(tokens) and torch.equal(got.kv, kv[:, :, start:])
    into = torch.empty(kv.numel() * kv.element_size(), dtype=torch.uint8)
    got = store.fetch("m", tokens, start=0, into=into)
    assert torch.equal(got.kv, kv) and got.kv.data_ptr() == into.data_ptr()


@pytest.mark.parametrize("cpu_codec", ["none", "int8"])
def test_demotion_encodes_on_the_tier_and_a_hit_promotes_back(make_store, cpu_codec):
    store = make_store(gpu_bytes=2 * SPEC.page_bytes, cpu_bytes=64 * SPEC.page_bytes, cpu_codec=cpu_codec)
    codec = get_codec(cpu_codec)
    first, second = list(range(100, 100 + 2 * SPEC.page_size)), list(range(500, 500 + 2 * SPEC.page_size))
    kv_first, kv_second = random_kv(SPEC, len(first), seed=2), random_kv(SPEC, len(second), seed=3)
    store.store("m", first, kv_first)
    store.store("m", second, kv_second)  # the off-host tier holds two pages: the first sequence goes down
    assert [tier.copies_out for tier in OffHostTier.made] == [2]
    assert store.stats()["tiers"]["gpu"]["demotions"] == 2
    assert store.lookup("m", first).tiers == {"cpu": len(first)}
    # What the CPU tier holds is the codec's encoding of the page, made on the off-host tier.
    expected = torch.empty_like(kv_first)
    for p in range(2):
        page = kv_first[:, :, p * SPEC.page_size:(p + 1) * SPEC.page_size]
        data = torch.empty(codec.encoded_bytes(SPEC, SPEC.page_size), dtype=torch.uint8)
        codec.encode(SPEC, page.contiguous(), data)
        codec.decode(SPEC, data, SPEC.page_size, expected[:, :, p * SPEC.page_size:(p + 1) * SPEC.page_size])
    got = store.fetch("m", first)
    assert got.matched_tokens == len(first) and torch.equal(got.kv, expected)
    assert store.stats()["tiers"]["gpu"]["promotions"] == 2
    assert store.lookup("m", first).tiers == {"gpu": len(first)}  # promoted from the answer
    again = store.fetch("m", first)
    assert torch.equal(again.kv, expected)
