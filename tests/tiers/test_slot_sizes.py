"""A CPU tier serving models of different page sizes: room freed by one model's pages serves the
other's, and the slot bookkeeping never hands out overlapping bytes."""
from __future__ import annotations

import random

import pytest
import torch

from kvstore import KVStore, ModelSpec, StoreConfig
from kvstore.tiers.base import TierFull
from kvstore.tiers.slots import SlotMap
from kv_tensors import random_kv

SMALL = ModelSpec(num_layers=1, num_kv_heads=8, head_dim=128, page_size=16)  # 64 KiB pages
LARGE = ModelSpec(num_layers=8, num_kv_heads=8, head_dim=128, page_size=16)  # 512 KiB pages


@pytest.fixture
def store(tmp_path):
    with KVStore(StoreConfig(data_dir=str(tmp_path), cpu_bytes=4 << 20, disk_bytes=0)) as s:
        s.register_model("small", SMALL)
        s.register_model("large", LARGE)
        yield s


def test_large_pages_take_the_room_small_pages_filled(store):
    for i in range(64):  # 64 x 64 KiB: the whole 4 MiB tier
        store.store("small", [i] * 16, random_kv(SMALL, 16, seed=i))
    kv = random_kv(LARGE, 64, seed=99)
    result = store.store("large", list(range(1000, 1064)), kv)  # 4 x 512 KiB: evicts small pages
    assert (result.stored_tokens, result.new_pages) == (64, 4)
    got = store.fetch("large", list(range(1000, 1064)))
    assert got.matched_tokens == 64 and torch.equal(got.kv, kv)


def test_dropping_a_model_frees_room_for_another_page_size(store):
    for i in range(64):
        store.store("small", [i] * 16, random_kv(SMALL, 16, seed=i))
    store.drop_model("small")
    kv = random_kv(LARGE, 128, seed=7)
    assert store.store("large", list(range(128)), kv).new_pages == 8  # the whole tier, in 512 KiB pages
    assert torch.equal(store.fetch("large", list(range(128))).kv, kv)
    assert store.stats()["tiers"]["cpu"]["evictions"] == 0


def test_slots_never_overlap_under_random_mixed_sizes():
    rng = random.Random(3)
    slots = SlotMap("cpu", 1 << 20, 64)
    held: dict[bytes, tuple[int, int]] = {}
    for step in range(20_000):
        if held and (rng.random() < 0.5 or len(held) > 200):
            key = rng.choice(list(held))
            assert slots.free(key)
            del held[key]
        else:
            key = step.to_bytes(4, "little")
            nbytes = rng.choice([64, 100, 4096, 65536, 3 * 65536])
            try:
                slot = slots.allocate(key, nbytes)
            except TierFull:
                continue
            assert slot == slots.get(key) and slot[1] == slots.slot_bytes(nbytes)
            held[key] = slot
        ranges = sorted(held.values())
        assert all(a + n <= b for (a, n), (b, _) in zip(ranges, ranges[1:]))  # no two slots overlap
        assert all(0 <= a and a + n <= slots.capacity_bytes for a, n in ranges)
        assert slots.used_bytes == sum(n for _, n in ranges)
    for key in list(held):
        slots.free(key)
    assert slots.used_bytes == 0 and slots.allocate(b"whole", 1 << 20) == (0, 1 << 20)  # all of it merged back
