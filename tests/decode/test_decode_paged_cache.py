"""The paged KV cache moves KV to and from the store layout (L, 2, T, H, D) without loss."""
from __future__ import annotations

import pytest
import torch

from decode.paged_cache import PagedKVCache
from kvstore.config import ModelSpec

SPEC = ModelSpec(num_layers=3, num_kv_heads=2, head_dim=4, dtype="float32", page_size=4)


def test_scatter_then_gather_round_trips_across_scattered_pages() -> None:
    cache = PagedKVCache(SPEC, num_blocks=8)
    other, table = cache.new_table(), cache.new_table()
    cache.reserve(other, 5)  # take pages first, so `table` gets non-adjacent, non-zero pages
    cache.reserve(table, 3)
    cache.reserve(other, 12)
    cache.reserve(table, 10)
    assert cache.free_blocks == 8 - 3 - 3
    kv = torch.randn(SPEC.kv_shape(10))  # (L, 2, T, H, D)
    cache.scatter(table, kv[:, :, :6])
    cache.scatter(table, kv[:, :, 6:], start=6)  # a second write starting mid-page
    assert torch.equal(cache.gather(table, 0, 10), kv)
    assert torch.equal(cache.gather(table, 3, 7), kv[:, :, 3:7])
    layer_k, _ = cache.layer(1)  # (N * P, H, D)
    assert torch.equal(layer_k[cache.slots(table, 0, 10)], kv[1, 0])


def test_reserve_beyond_capacity_fails_and_release_returns_pages() -> None:
    cache = PagedKVCache(SPEC, num_blocks=2)
    table = cache.new_table()
    with pytest.raises(MemoryError):
        cache.reserve(table, 9)
    cache.reserve(table, 8)
    cache.release(table)
    assert cache.free_blocks == 2 and table.blocks == []
