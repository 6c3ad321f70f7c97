"""A fetch copies pages that lie next to each other in the CPU slab with one numpy call
(kvstore/fetch_plan.py `copy_raw_pages`), and every other page on its own: the KV a caller gets
must be the same bytes either way, whatever the slab layout, start, into= or page split."""
import tempfile

import pytest
import torch

from kvstore import KVStore, ModelSpec, StoreConfig

SPEC = ModelSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
BF16 = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4)


def make_store(cpu_pages: int = 64, spec: ModelSpec = SPEC) -> KVStore:
    store = KVStore(StoreConfig(data_dir=tempfile.mkdtemp(), cpu_bytes=cpu_pages * spec.page_bytes, disk_bytes=0))
    store.register_model("m", spec)
    return store


def kv_for(spec: ModelSpec, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(spec.kv_shape(n), generator=g).to(getattr(torch, spec.dtype))


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.equal(a.view(torch.int16), b.view(torch.int16))


@pytest.mark.parametrize("spec", [SPEC, BF16], ids=["float16", "bfloat16"])
def test_a_sequence_stored_at_once_comes_back_whole_and_in_parts(spec):
    store = make_store(spec=spec)
    tokens = list(range(100, 100 + 8 * spec.page_size + 3))  # 8 full pages and a tail
    kv = kv_for(spec, len(tokens), 1)
    assert store.store("m", tokens, kv).stored_tokens == len(tokens)
    got = store.fetch("m", tokens)
    assert got.matched_tokens == len(tokens) and same_bits(got.kv, kv)
    for start in (1, 3, 4, 9, 30, len(tokens) - 1):  # from inside a page, at a page edge, in the tail
        got = store.fetch("m", tokens, start=start)
        assert got.matched_tokens == len(tokens) and same_bits(got.kv, kv[:, :, start:])
    # A prompt that leaves the stored one inside page 6: the match ends inside that page.
    diverging = tokens[:6 * spec.page_size + 2] + [7, 7, 7, 7, 7]
    got = store.fetch("m", diverging, start=5)
    assert got.matched_tokens == 6 * spec.page_size + 2 and same_bits(got.kv, kv[:, :, 5:got.matched_tokens])
    into = torch.full((kv.numel() * 2 + 64,), 0xAB, dtype=torch.uint8)
    got = store.fetch("m", tokens, start=2, into=into)
    assert same_bits(got.kv, kv[:, :, 2:])
    assert got.kv.data_ptr() == into.data_ptr()


def test_pages_scattered_over_the_slab_come_back_exact():
    store = make_store()
    P = SPEC.page_size
    a, b = list(range(1000, 1000 + 8 * P)), list(range(5000, 5000 + 8 * P))
    kv_a, kv_b = kv_for(SPEC, len(a), 2), kv_for(SPEC, len(b), 3)
    for end in range(P, 8 * P + 1, P):  # one page of each in turn: a's pages sit between b's
        assert store.store("m", a[:end], kv_a[:, :, end - P:end], start=end - P).stored_tokens == end
        assert store.store("m", b[:end], kv_b[:, :, end - P:end], start=end - P).stored_tokens == end
    for tokens, kv in ((a, kv_a), (b, kv_b)):
        for start in (0, 1, 4, 13):
            got = store.fetch("m", tokens, start=start)
            assert got.matched_tokens == len(tokens) and same_bits(got.kv, kv[:, :, start:])


def test_slots_reused_after_evictions_come_back_exact():
    store = make_store(cpu_pages=12)
    P = SPEC.page_size
    prompts = [list(range(10_000 * i, 10_000 * i + 5 * P)) for i in range(1, 9)]
    kvs = [kv_for(SPEC, 5 * P, 10 + i) for i in range(8)]
    for tokens, kv in zip(prompts, kvs):  # 5 pages each into 12: every store evicts older pages
        assert store.store("m", tokens, kv).stored_tokens == 5 * P
        got = store.fetch("m", tokens)
        assert got.matched_tokens == 5 * P and same_bits(got.kv, kv)
    for tokens, kv in zip(prompts, kvs):  # whatever is still held is the stored bytes
        got = store.fetch("m", tokens)
        assert got.matched_tokens % P == 0
        assert same_bits(got.kv, kv[:, :, :got.matched_tokens])
    assert store.fetch("m", prompts[-1]).matched_tokens == 5 * P
