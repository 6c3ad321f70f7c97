"""KVStore.fetch_pinned: the pages of a fetch where they lie, pinned until released."""
from __future__ import annotations

import pytest
import torch

from kvstore import ModelSpec

SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32", page_size=4)


def _kv(spec: ModelSpec, tokens: list[int]) -> torch.Tensor:
    """(L, 2, T, H, D), each token's KV a function of its id, so a misplaced page shows."""
    ids = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None, None]
    layers = torch.arange(spec.num_layers, dtype=torch.float32)[:, None, None, None, None]
    return (ids + 1000 * layers).expand(spec.kv_shape(len(tokens))).to(getattr(torch, spec.dtype)).contiguous()


def _joined(pinned, spec: ModelSpec) -> torch.Tensor:
    """The runs laid end to end as (L, 2, T, H, D), checking they are contiguous in tokens."""
    parts, expected_first = [], 0
    for run in pinned.runs:
        assert run.first == expected_first
        k = run.pages.shape[0]
        # (k, L, 2, P, H, D) -> (L, 2, k * P, H, D)
        parts.append(run.pages.permute(1, 2, 0, 3, 4, 5).reshape(spec.num_layers, 2, k * spec.page_size,
                                                                  spec.num_kv_heads, spec.head_dim))
        expected_first += k * spec.page_size
    return torch.cat(parts, dim=2)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_the_runs_hold_exactly_what_fetch_answers_without_the_tail(make_store, dtype):
    spec = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype, page_size=4)
    store = make_store(cpu_bytes=1 << 20, disk_bytes=0)
    store.register_model("m", spec)
    tokens = list(range(100, 118))  # 4 whole pages and a tail of 2
    kv = _kv(spec, tokens)
    store.store("m", tokens, kv)
    with store.fetch_pinned("m", tokens, start=4) as pinned:
        assert pinned.matched_tokens == 18
        assert pinned.in_place_tokens == 16  # the tail is not handed out in place
        assert torch.equal(_joined(pinned, spec), kv[:, :, 4:16])
    assert torch.equal(store.fetch("m", tokens, start=4).kv, kv[:, :, 4:])


def test_a_sequence_stored_in_pieces_comes_in_several_runs_in_token_order(make_store):
    store = make_store(cpu_bytes=1 << 20, disk_bytes=0)
    store.register_model("m", SPEC)
    a, b = list(range(0, 32)), list(range(500, 532))
    kv_a = _kv(SPEC, a)
    # a's second half is stored after b: its pages sit past b's in the buffer
    store.store("m", a[:16], kv_a[:, :, :16])
    store.store("m", b, _kv(SPEC, b))
    store.store("m", a, kv_a[:, :, 16:], start=16)
    with store.fetch_pinned("m", a) as pinned:
        assert pinned.runs is not None and len(pinned.runs) >= 2
        assert pinned.in_place_tokens == 32
        assert torch.equal(_joined(pinned, SPEC), kv_a)


def test_pinned_pages_survive_eviction_until_released(make_store):
    page_bytes = SPEC.page_size * SPEC.bytes_per_token
    store = make_store(cpu_bytes=8 * page_bytes, disk_bytes=0)  # room for 8 pages
    store.register_model("m", SPEC)
    held = list(range(0, 16))  # 4 pages
    store.store("m", held, _kv(SPEC, held))
    pinned = store.fetch_pinned("m", held)
    assert pinned.in_place_tokens == 16
    for i in range(6):  # 24 pages of other prompts: everything unpinned is evicted
        other = list(range(10_000 * (i + 1), 10_000 * (i + 1) + 16))
        store.store("m", other, _kv(SPEC, other))
    assert torch.equal(_joined(pinned, SPEC), _kv(SPEC, held))  # its bytes were not reused
    assert store.lookup("m", held).matched_tokens == 16
    pinned.release()
    pinned.release()  # a second release does nothing
    for i in range(6, 12):
        other = list(range(10_000 * (i + 1), 10_000 * (i + 1) + 16))
        store.store("m", other, _kv(SPEC, other))
    assert store.lookup("m", held).matched_tokens == 0  # released: evictable like any page


def test_pages_on_disk_are_not_in_place_and_fetch_copies_them(make_store):
    store = make_store(cpu_bytes=0, disk_bytes=8 << 20)
    store.register_model("m", SPEC)
    tokens = list(range(40))
    kv = _kv(SPEC, tokens)
    store.store("m", tokens, kv)
    pinned = store.fetch_pinned("m", tokens, start=8)
    assert pinned.runs is None and pinned.in_place_tokens == 8
    got = pinned.fetch()
    assert got.matched_tokens == 40 and torch.equal(got.kv, kv[:, :, 8:])
    pinned.release()  # after fetch: nothing left to release


def test_a_miss_has_no_runs_to_read_and_counts_fetched_tokens_on_release(make_store):
    store = make_store(cpu_bytes=1 << 20, disk_bytes=0)
    store.register_model("m", SPEC)
    with store.fetch_pinned("m", [1, 2, 3, 4, 5]) as pinned:
        assert pinned.matched_tokens == 0 and pinned.runs == []
    tokens = list(range(12))
    store.store("m", tokens, _kv(SPEC, tokens))
    before = store.stats()["fetched_tokens"]
    with store.fetch_pinned("m", tokens, start=4):
        pass
    assert store.stats()["fetched_tokens"] == before + 8
