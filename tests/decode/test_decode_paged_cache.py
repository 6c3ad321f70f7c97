"""The paged KV cache moves KV to and from the store layout (L, 2, T, H, D) without loss."""
from __future__ import annotations

import pytest
import torch

from kvstore.decode.paged_cache import PagedKVCache
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


def test_attention_is_the_same_over_scattered_and_consecutive_pages() -> None:
    from kvstore.decode import tiny_model
    from kvstore.decode.attention import AttentionContext

    model = tiny_model(page_size=4)
    ids = torch.randint(0, 512, (23,), generator=torch.Generator().manual_seed(0))  # (T,)

    def run(scattered: bool) -> list[torch.Tensor]:
        cache = PagedKVCache(model.spec, num_blocks=16)
        table, other = cache.new_table(), cache.new_table()
        for n in range(4, 25, 4):  # grow page by page; `other` takes every other page when scattered
            cache.reserve(table, n)
            if scattered:
                cache.reserve(other, n)
        assert (cache.slot_range(table, 0, 23) is None) == scattered
        out = []
        for start, end in ((0, 13), (13, 22), (22, 23)):  # prefill, suffix prefill, one decode step
            ctx = AttentionContext.for_span(cache, table, start, end)
            out.append(model(ids[start:end], torch.arange(start, end), cache, ctx, logits="all"))
            table.num_tokens = end
        out.append(cache.gather(table, 0, 23))
        return out

    for a, b in zip(run(False), run(True)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=0)
