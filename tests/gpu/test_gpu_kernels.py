"""The CUDA kernels against their torch references (exact for copies, bit-exact or within one
quantization step for codecs, float32 rounding for RoPE), and the GPU tier on a real device.
Every test here is marked `gpu`: skipped, with the reason, without CUDA and CuPy."""
from __future__ import annotations

import pytest
import torch

from kvstore.gpu.paged import gather_pages, gather_pages_ref, scatter_pages, scatter_pages_ref
from kvstore.gpu.quant import dequantize, dequantize_ref, quantize, quantize_ref
from kvstore.gpu.rope import apply_rope_ref, rope_rerotate, rope_rerotate_ref
from kvstore.codecs import get_codec
from kvstore.config import ModelSpec

pytestmark = pytest.mark.gpu
DTYPES = [torch.float16, torch.bfloat16, torch.float32]
CUDA = "cuda"


def _blocked(nb: int, L: int, P: int, H: int, D: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.randn(nb, L, 2, P, H, D, device=CUDA).to(dtype)  # (num_blocks, L, 2, P, H, D)


def _split(blocked: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """The per-layer layout with the same contents: contiguous (num_blocks, P, H, D) tensors."""
    L = blocked.shape[1]
    return ([blocked[:, layer, 0].contiguous() for layer in range(L)],
            [blocked[:, layer, 1].contiguous() for layer in range(L)])


def _join(cache: tuple[list[torch.Tensor], list[torch.Tensor]]) -> torch.Tensor:
    return torch.stack([torch.stack([k, v], 1) for k, v in zip(*cache)], 1)  # (num_blocks, L, 2, P, H, D)


@pytest.mark.parametrize("dtype", DTYPES + [torch.float8_e4m3fn])
@pytest.mark.parametrize("shape", [(3, 16, 8, 128), (2, 5, 3, 7), (4, 1, 1, 2)])  # (L, P, H, D); odd rows too
@pytest.mark.parametrize("layout", ["blocked", "per_layer"])
def test_gather_scatter_match_reference_exactly(dtype: torch.dtype, shape: tuple[int, ...], layout: str) -> None:
    L, P, H, D = shape
    src = torch.randn(11, L, 2, P, H, D, device=CUDA).to(dtype)  # (num_blocks, L, 2, P, H, D)
    make = (lambda t: t) if layout == "blocked" else _split
    back = (lambda c: c) if layout == "blocked" else _join
    ids = torch.tensor([9, 0, 4, 7], device=CUDA, dtype=torch.int32)
    for T in (4 * P, 3 * P + 1):  # full pages, then a one-token tail
        got = gather_pages(make(src), ids, T)
        assert torch.equal(got.view(torch.uint8), gather_pages_ref(make(src), ids, T).view(torch.uint8))
        kv = torch.randn(L, 2, T, H, D, device=CUDA).to(dtype)
        mine, ref = make(torch.zeros_like(src)), make(torch.zeros_like(src))
        scatter_pages(kv, mine, ids)
        scatter_pages_ref(kv, ref, ids)
        assert torch.equal(back(mine).view(torch.uint8), back(ref).view(torch.uint8))


def test_gather_into_given_out_and_bounds() -> None:
    cache = _blocked(6, 2, 4, 2, 64, torch.float16)
    out = torch.empty(2, 2, 8, 2, 64, dtype=torch.float16, device=CUDA)
    assert gather_pages(cache, [5, 1], out=out) is out
    assert torch.equal(out, gather_pages_ref(cache, [5, 1]))
    with pytest.raises(IndexError):
        gather_pages(cache, [6])
    with pytest.raises(ValueError, match="distinct"):
        scatter_pages(out, cache, [1, 1])


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("D", [128, 64, 6, 33])  # vector path and scalar path
def test_quantize_dequantize_match_reference(fmt: str, dtype: torch.dtype, D: int) -> None:
    x = (torch.randn(3, 2, 17, 4, D, device=CUDA) * 5)
    x[..., 0] *= 100
    x[0, 0, 0] = 0  # a zero row
    x = x.to(dtype)
    q, s = quantize(x, fmt)
    q_ref, s_ref = quantize_ref(x, fmt)
    assert torch.equal(s.view(torch.int16), s_ref.view(torch.int16))
    diff = (q.view(torch.uint8).int() - q_ref.view(torch.uint8).int()).abs()
    assert diff.max() <= 1, "within one quantization step"  # bit-exact expected; one step allowed
    for out_dtype in DTYPES:
        got, ref = dequantize(q_ref, s_ref, fmt, out_dtype), dequantize_ref(q_ref, s_ref, out_dtype)
        assert torch.equal(got.view(torch.uint8), ref.view(torch.uint8))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_rope_rerotate_matches_reference_in_place_on_kv_view(dtype: torch.dtype, style: str) -> None:
    L, T, H, D = 3, 19, 4, 128
    kv = torch.randn(L, 2, T, H, D, device=CUDA).to(dtype)  # (L, 2, T, H, D)
    delta = torch.arange(T, device=CUDA) * 3 + 1000
    ref = rope_rerotate_ref(kv[:, 0], delta, theta=1e6, style=style)
    v_before = kv[:, 1].clone()
    out = rope_rerotate(kv[:, 0], delta, theta=1e6, style=style, out=kv[:, 0])  # in place, strided view
    tol = {torch.float32: 1e-6, torch.float16: 1e-3, torch.bfloat16: 1e-2}[dtype]
    assert (out.float() - ref.float()).abs().max() <= tol
    assert torch.equal(kv[:, 1], v_before)  # V untouched
    fresh = rope_rerotate(v_before, 5, theta=1e6, style=style)
    assert (fresh.float() - rope_rerotate_ref(v_before, 5, theta=1e6, style=style).float()).abs().max() <= tol


def test_rope_rerotate_kernel_equals_rope_at_new_positions() -> None:
    k = torch.randn(2, 32, 2, 64, device=CUDA)
    at_p = apply_rope_ref(k, torch.arange(32), theta=1e4, style="neox")
    moved = rope_rerotate(at_p, 4000, theta=1e4, style="neox")
    assert (moved - apply_rope_ref(k, torch.arange(32) + 4000, theta=1e4, style="neox")).abs().max() <= 1e-5


@pytest.mark.parametrize("codec_name", ["int8", "fp8"])
def test_codec_on_cuda_equals_codec_on_cpu(codec_name: str) -> None:
    spec = ModelSpec(num_layers=2, num_kv_heads=4, head_dim=128, dtype="bfloat16", page_size=16)
    codec = get_codec(codec_name)
    kv = torch.randn(spec.kv_shape(11)).to(torch.bfloat16)
    cpu_bytes = torch.empty(codec.encoded_bytes(spec, 11), dtype=torch.uint8)
    codec.encode(spec, kv, cpu_bytes)
    cross = torch.empty_like(cpu_bytes)
    codec.encode(spec, kv.to(CUDA), cross)  # quantized on the GPU, compact bytes copied down
    assert torch.equal(cross, cpu_bytes)
    out = torch.empty(spec.kv_shape(11), dtype=torch.bfloat16, device=CUDA)
    codec.decode(spec, cpu_bytes, 11, out)  # compact bytes copied up, dequantized on the GPU
    ref = torch.empty(spec.kv_shape(11), dtype=torch.bfloat16)
    codec.decode(spec, cpu_bytes, 11, ref)
    assert torch.equal(out.cpu(), ref)


def test_gpu_tier_slots_and_pcie_copies() -> None:
    from kvstore.tiers.base import TierFull
    from kvstore.tiers.gpu import GPUTier

    spec = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=64, dtype="float16", page_size=16)
    tier = GPUTier(3 * GPUTier.slot_bytes(spec.page_bytes))
    kv = torch.randn(spec.kv_shape(16)).half()
    slot = tier.view(tier.allocate(b"a", spec.page_bytes), spec.page_bytes)
    assert slot.is_cuda and slot.numel() == spec.page_bytes
    get_codec("none").encode(spec, kv, slot)
    tier.allocate(b"b", spec.page_bytes)
    tier.allocate(b"c", spec.page_bytes)
    with pytest.raises(TierFull):
        tier.allocate(b"d", 10)
    int8 = get_codec("int8")
    host = torch.empty(int8.encoded_bytes(spec, 16), dtype=torch.uint8).pin_memory()
    tier.copy_out(b"a", spec, 16, int8, host).synchronize()
    expected = torch.empty_like(host)
    int8.encode(spec, kv, expected)
    assert torch.equal(host, expected)  # quantized on the device: half the bytes crossed
    pageable = torch.empty(spec.page_bytes, dtype=torch.uint8)  # what a record tier (disk, Redis) gets
    tier.copy_out(b"a", spec, 16, get_codec("none"), pageable).synchronize()
    assert not pageable.is_cuda and torch.equal(pageable.view(torch.float16).view(kv.shape), kv)
    assert tier.delete(b"b") and not tier.delete(b"b")
    # Promotion as the store makes it: the hit's KV, decoded on the host, encoded into a new slot.
    ref = torch.empty(spec.kv_shape(16), dtype=torch.float16)
    int8.decode(spec, host, 16, ref)
    get_codec("none").encode(spec, ref, tier.view(tier.allocate(b"e", spec.page_bytes), spec.page_bytes))
    back = torch.empty(spec.kv_shape(16), dtype=torch.float16)
    held = tier.get(b"e")
    assert held is not None and tier.get(b"b") is None
    get_codec("none").decode(spec, tier.view(held, spec.page_bytes), 16, back)
    assert torch.equal(back, ref)
    assert len(tier) == 3 and b"e" in tier
    tier.close()
