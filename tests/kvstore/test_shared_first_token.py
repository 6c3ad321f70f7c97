"""Prompts that all start with the same token (a BOS token, a shared system prompt's first page):
a root then has many children with the same first token, and partial matches, tail folding and
the bytes served must be what a brute-force search over every stored sequence gives."""
from __future__ import annotations

import random

import pytest
import torch

from kvstore import KVStore, ModelSpec, StoreConfig
from kv_tensors import random_kv

SPEC = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", page_size=16)
BOS = 1


def longest_common_run(prompt: list[int], stored: list[list[int]]) -> int:
    best = 0
    for seq in stored:
        n = 0
        while n < min(len(seq), len(prompt)) and seq[n] == prompt[n]:
            n += 1
        best = max(best, n)
    return best


@pytest.fixture
def store(tmp_path):
    with KVStore(StoreConfig(data_dir=str(tmp_path), cpu_bytes=64 << 20, disk_bytes=0)) as s:
        s.register_model("m", SPEC)
        yield s


def test_partial_matches_among_many_siblings_are_the_longest_run(store):
    rng = random.Random(7)
    # Few distinct ids, so many stored sequences share runs of several tokens after BOS.
    stored = [[BOS] + [rng.randrange(4) for _ in range(rng.randrange(3, 40))] for _ in range(400)]
    kv_of = {}
    for i, seq in enumerate(stored):
        kv_of[tuple(seq)] = kv = random_kv(SPEC, len(seq), seed=i)
        store.store("m", seq, kv)
    for _ in range(300):
        base = rng.choice(stored)
        prompt = base[:rng.randrange(1, len(base) + 1)] + [rng.randrange(4) for _ in range(rng.randrange(0, 20))]
        want = longest_common_run(prompt, stored)
        got = store.fetch("m", prompt)
        assert got.matched_tokens == want, prompt
        assert store.lookup("m", prompt).matched_tokens == want
        # The KV served is the KV some stored sequence holding those tokens was stored with.
        sources = [kv for seq, kv in kv_of.items() if list(seq[:want]) == prompt[:want]]
        assert any(torch.equal(got.kv, kv[:, :, :want]) for kv in sources)


def test_a_longer_tail_replaces_the_shorter_one_among_many_siblings(store):
    others = [[BOS, 100 + i, 7] for i in range(200)]  # 200 tail pages under the root, all after BOS
    for i, seq in enumerate(others):
        store.store("m", seq, random_kv(SPEC, 3, seed=i))
    short, longer = [BOS, 5, 6, 7], [BOS, 5, 6, 7, 8, 9]
    store.store("m", short, random_kv(SPEC, 4, seed=1000))
    pages = store.stats()["tiers"]["cpu"]["pages"]
    kv = random_kv(SPEC, 6, seed=1001)
    store.store("m", longer, kv)
    assert store.stats()["tiers"]["cpu"]["pages"] == pages  # the 4-token tail gave way to the 6-token one
    got = store.fetch("m", short)
    assert got.matched_tokens == 4 and torch.equal(got.kv, kv[:, :, :4])
    # A tail that a cached sibling already starts with is that sibling: nothing new is stored.
    result = store.store("m", [BOS, 5, 6], random_kv(SPEC, 3, seed=1002))
    assert (result.stored_tokens, result.new_pages) == (3, 0)
    assert torch.equal(store.fetch("m", [BOS, 5, 6]).kv, kv[:, :, :3])
    for i, seq in enumerate(others):  # the siblings are untouched
        assert torch.equal(store.fetch("m", seq).kv, random_kv(SPEC, 3, seed=i))
