"""int8 / fp8 page codecs through the Codec API: sizes, full and tail pages, error bounds, slots at
odd offsets, and the CPU-tier capacity gain."""
from __future__ import annotations

import pytest
import torch

from kvstore.codecs import CODECS, get_codec
from kvstore.gpu.dtypes import KV_DTYPES
from kvstore.config import ModelSpec


def _spec(dtype: str = "float16", head_dim: int = 64) -> ModelSpec:
    return ModelSpec(num_layers=2, num_kv_heads=2, head_dim=head_dim, dtype=dtype, page_size=8)


def _kv(spec: ModelSpec, n: int, seed: int = 0) -> torch.Tensor:
    x = torch.randn(spec.kv_shape(n), generator=torch.Generator().manual_seed(seed)) * 4  # (L, 2, n, H, D)
    x[:, 0, ..., 3] *= 50  # an outlier channel in K, as real models have
    return x.to(KV_DTYPES[spec.dtype])


def _roundtrip(codec_name: str, spec: ModelSpec, kv: torch.Tensor, data: torch.Tensor | None = None) -> torch.Tensor:
    codec = get_codec(codec_name)
    n = kv.shape[2]
    data = torch.empty(codec.encoded_bytes(spec, n), dtype=torch.uint8) if data is None else data
    codec.encode(spec, kv, data)
    out = torch.empty(spec.kv_shape(n), dtype=kv.dtype)  # (L, 2, n, H, D)
    codec.decode(spec, data, n, out)
    return out


def test_codecs_register_through_get_codec() -> None:
    assert get_codec("int8").name == "int8" and get_codec("fp8").name == "fp8"
    assert {"none", "int8", "fp8"} <= set(CODECS)


@pytest.mark.parametrize("codec_name", ["int8", "fp8"])
@pytest.mark.parametrize("n", [8, 5, 1])  # a full page and tail pages
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_roundtrip_within_the_stated_bound(codec_name: str, n: int, dtype: str) -> None:
    spec = _spec(dtype)
    kv = _kv(spec, n)
    assert get_codec(codec_name).encoded_bytes(spec, n) == 2 * 2 * n * 2 * (64 + 2)
    out = _roundtrip(codec_name, spec, kv)
    x, err = kv.float(), (out.float() - kv.float()).abs()
    amax = x.abs().amax(-1, keepdim=True)
    ulp = {"float16": 2.0**-11, "bfloat16": 2.0**-8, "float32": 2.0**-24}[dtype]
    if codec_name == "int8":
        bound = amax / 127 * (1 + 2**-7) / 2 + out.float().abs() * ulp
    else:
        bound = torch.maximum(x.abs() * 2**-4, amax / 448 * (1 + 2**-7) * 2**-10) + out.float().abs() * ulp
    assert (err <= bound).all()


@pytest.mark.parametrize("codec_name", ["int8", "fp8"])
def test_tail_page_encoding_is_the_prefix_of_nothing_else(codec_name: str) -> None:
    # A tail page of n tokens decodes from exactly encoded_bytes(spec, n), read out of a full-page slot.
    spec = _spec()
    codec = get_codec(codec_name)
    slot = torch.full((codec.encoded_bytes(spec, spec.page_size),), 0xAB, dtype=torch.uint8)
    kv = _kv(spec, 3)
    codec.encode(spec, kv, slot[:codec.encoded_bytes(spec, 3)])
    assert (slot[codec.encoded_bytes(spec, 3):] == 0xAB).all()  # nothing written past the page
    out = torch.empty(spec.kv_shape(3), dtype=kv.dtype)
    codec.decode(spec, slot[:codec.encoded_bytes(spec, 3)], 3, out)
    assert torch.equal(out, _roundtrip(codec_name, spec, kv))


@pytest.mark.parametrize("codec_name", ["int8", "fp8"])
def test_slot_at_odd_offset_and_strided_kv(codec_name: str) -> None:
    spec = _spec(head_dim=63)  # odd D puts the scales at an odd byte offset too
    kv_full = _kv(spec, 6)
    kv = kv_full.transpose(3, 4).contiguous().transpose(3, 4)  # same values, non-contiguous
    nbytes = get_codec(codec_name).encoded_bytes(spec, 6)
    slab = torch.zeros(nbytes + 1, dtype=torch.uint8)
    out = _roundtrip(codec_name, spec, kv, data=slab[1:])
    assert torch.equal(out, _roundtrip(codec_name, spec, kv_full))


@pytest.mark.parametrize("head_dim", [64, 128, 256])
def test_int8_holds_at_least_1_9x_float16_pages(head_dim: int) -> None:
    spec = _spec("float16", head_dim)
    assert spec.page_bytes / get_codec("int8").encoded_bytes(spec, spec.page_size) >= 1.9


def test_wrong_sizes_are_rejected() -> None:
    spec = _spec()
    codec = get_codec("int8")
    with pytest.raises(ValueError, match="bytes"):
        codec.encode(spec, _kv(spec, 4), torch.empty(10, dtype=torch.uint8))
    with pytest.raises(ValueError, match="kv"):
        codec.encode(spec, _kv(spec, 4).float(), torch.empty(codec.encoded_bytes(spec, 4), dtype=torch.uint8))
    with pytest.raises(ValueError, match="out"):
        codec.decode(spec, torch.empty(codec.encoded_bytes(spec, 4), dtype=torch.uint8), 4, torch.empty(3))
