"""KVStore.blend / store_chunk (CacheBlend): hits need the whole chunk, KV lands at its new
positions with K re-rotated exactly, misses are zeros, and what cannot be exact is refused.

The re-rotation identity itself (p -> p + delta equals RoPE at p + delta, 1e-5 in float32, neox
and gptj) is tested on the reference in tests/gpu/test_gpu_rope_ref.py and against the CUDA
kernel in tests/gpu/test_gpu_kernels.py; here it is checked end to end through the store."""
from __future__ import annotations

import pytest
import torch

from kvstore.gpu.rope import apply_rope_ref
from kvstore import KVStore, ModelSpec, StoreConfig
from kvstore.errors import InvalidStart, InvalidTokens, PayloadTooLarge, Unsupported


def spec_for(style: str = "neox", **kw) -> ModelSpec:
    return ModelSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", page_size=4,
                     rope_style=style, **kw)


@pytest.fixture
def store():
    with KVStore(StoreConfig(data_dir=None, cpu_bytes=16 << 20, disk_bytes=0)) as s:
        yield s


def chunk_kv(spec: ModelSpec, n: int, seed: int, at: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(raw K before RoPE (L, n, H, D), KV (L, 2, n, H, D) with K rotated at positions at..at+n-1)."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn((spec.num_layers, n, spec.num_kv_heads, spec.head_dim), generator=gen)  # (L, n, H, D)
    kv = torch.randn(spec.kv_shape(n), generator=gen)  # (L, 2, n, H, D)
    kv[:, 0] = apply_rope_ref(raw, torch.arange(at, at + n), theta=spec.rope_theta, style=spec.rope_style)
    return raw, kv


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_blend_rerotates_k_to_the_new_positions(store: KVStore, style: str):
    spec = spec_for(style)
    store.register_model("m", spec)
    a, b = list(range(100, 110)), list(range(200, 207))
    raw_a, kv_a = chunk_kv(spec, 10, seed=1)
    raw_b, kv_b = chunk_kv(spec, 7, seed=2)
    store.store_chunk("m", a, kv_a)
    store.store_chunk("m", b, kv_b)
    result = store.blend("m", [b, a], start_pos=1000)
    assert result.hits == [True, True] and result.positions == [(1000, 1007), (1007, 1017)]
    assert result.kv.shape == spec.kv_shape(17)
    # K equals RoPE computed directly at the new positions; V is unchanged.
    want_b = apply_rope_ref(raw_b, torch.arange(1000, 1007), theta=spec.rope_theta, style=style)
    want_a = apply_rope_ref(raw_a, torch.arange(1007, 1017), theta=spec.rope_theta, style=style)
    assert (result.kv[:, 0, :7] - want_b).abs().max() <= 1e-5
    assert (result.kv[:, 0, 7:] - want_a).abs().max() <= 1e-5
    assert torch.equal(result.kv[:, 1, :7], kv_b[:, 1]) and torch.equal(result.kv[:, 1, 7:], kv_a[:, 1])


def test_start_pos_zero_returns_the_stored_kv(store: KVStore):
    spec = spec_for()
    store.register_model("m", spec)
    _, kv = chunk_kv(spec, 9, seed=3)
    store.store_chunk("m", list(range(9)), kv)
    assert torch.equal(store.blend("m", [list(range(9))]).kv, kv)


def test_misses_are_zeros_and_a_chunk_hits_only_whole(store: KVStore):
    spec = spec_for()
    store.register_model("m", spec)
    _, kv = chunk_kv(spec, 8, seed=4)
    chunk = list(range(50, 58))
    store.store_chunk("m", chunk, kv)
    result = store.blend("m", [chunk[:5], chunk, chunk + [1], [7, 8, 9]], start_pos=3)
    assert result.hits == [False, True, False, False]
    assert result.positions == [(3, 8), (8, 16), (16, 25), (25, 28)]
    assert not result.kv[:, :, :5].any() and not result.kv[:, :, 13:].any()
    assert torch.equal(result.kv[:, 1, 5:13], kv[:, 1])


def test_chunks_are_not_prefixes_and_stay_in_their_tenant(store: KVStore):
    spec = spec_for()
    store.register_model("m", spec, tenant="a")
    store.register_model("m", spec, tenant="b")
    _, kv = chunk_kv(spec, 8, seed=5)
    store.store_chunk("m", list(range(8)), kv, tenant="a")
    assert store.lookup("m", list(range(8)), tenant="a").matched_tokens == 0  # chunk keys are their own trees
    assert store.blend("m", [list(range(8))], tenant="a").hits == [True]
    assert store.blend("m", [list(range(8))], tenant="b").hits == [False]


@pytest.mark.parametrize("kind", ["dynamic", "yarn", "longrope"])
def test_rope_that_is_not_a_pure_shift_is_refused(store: KVStore, kind: str):
    spec = spec_for(rope_scaling={"rope_type": kind, "factor": 2.0})
    store.register_model("m", spec)
    with pytest.raises(Unsupported, match=kind) as err:
        store.blend("m", [[1, 2, 3]], start_pos=5)
    assert err.value.status == 422


def test_linear_and_llama3_scalings_are_blended(store: KVStore):
    spec = spec_for(rope_scaling={"rope_type": "linear", "factor": 4.0})
    store.register_model("m", spec)
    raw, kv = chunk_kv(spec, 6, seed=6)
    kv[:, 0] = apply_rope_ref(raw, torch.arange(6), theta=spec.rope_theta, style="neox",
                              rope_scaling=spec.rope_scaling_dict)
    store.store_chunk("m", list(range(6)), kv)
    got = store.blend("m", [list(range(6))], start_pos=40).kv[:, 0]
    want = apply_rope_ref(raw, torch.arange(40, 46), theta=spec.rope_theta, style="neox",
                          rope_scaling=spec.rope_scaling_dict)
    assert (got - want).abs().max() <= 1e-5


@pytest.mark.parametrize("chunks,start_pos,error", [
    ([], 0, InvalidTokens), ([[]], 0, InvalidTokens), ([[1]] * 4097, 0, InvalidTokens), ([[1, -2]], 0, InvalidTokens),
    ("abc", 0, InvalidTokens),
    ([[1, 2]], -1, InvalidStart), ([[1, 2]], 1.5, InvalidStart), ([[1, 2]], True, InvalidStart)])
def test_bad_input_names_the_field(store: KVStore, chunks, start_pos, error):
    store.register_model("m", spec_for())
    with pytest.raises(error):
        store.blend("m", chunks, start_pos=start_pos)


def test_an_answer_of_misses_is_bounded_too(store: KVStore):
    spec = ModelSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", page_size=16)  # 128 KiB/token
    store.register_model("big", spec)
    with pytest.raises(PayloadTooLarge, match="chunks"):
        store.blend("big", [list(range(5000)), list(range(5000, 10000))])
