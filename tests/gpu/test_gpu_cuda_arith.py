"""The header-free conversions in gpu/kernels.cu, transcribed to torch integer ops and checked
against torch's own casts on CPU: the CUDA code itself only runs where there is a GPU, but its
bit tricks (e4m3 encode/decode, bfloat16 round-to-nearest-even) are verified everywhere.
Keep these in step with kernels.cu."""
from __future__ import annotations

import torch


def _fp8_encode_like_kernel(v: torch.Tensor) -> torch.Tensor:
    """kernels.cu fp8_e4m3_encode, elementwise: float32 -> uint8 code."""
    v = v.clamp(-448.0, 448.0)
    sign = (v.view(torch.int32) >> 24) & 0x80
    a = v.abs()
    sub = torch.round(a * 512.0).to(torch.int32)  # rintf: half to even, like torch.round
    u = a.view(torch.int32).to(torch.int64)
    u = u + 0x7FFFF + ((u >> 20) & 1)
    exp = (u >> 23) - 127 + 7
    normal = (exp << 3) | ((u >> 20) & 7)
    code = torch.where(a < 0.015625, sub.to(torch.int64), normal)
    return (sign.to(torch.int64) | code).to(torch.uint8)


def _fp8_decode_like_kernel(c: torch.Tensor) -> torch.Tensor:
    c = c.to(torch.int32)
    exp, man = (c >> 3) & 15, c & 7
    sub = man.float() * 0.001953125
    normal = (((exp + 120) << 23) | (man << 20)).view(torch.float32)
    a = torch.where(exp == 0, sub, normal)
    a = torch.where((exp == 15) & (man == 7), torch.tensor(float("nan")), a)
    return torch.where((c & 0x80) != 0, -a, a)


def _bf16_store_like_kernel(f: torch.Tensor) -> torch.Tensor:
    u = f.view(torch.int32).to(torch.int64) & 0xFFFFFFFF
    rounded = ((u + 0x7FFF + ((u >> 16) & 1)) >> 16) & 0xFFFF
    nan = (u & 0x7FFFFFFF) > 0x7F800000
    bits = torch.where(nan, (u >> 16) | 0x40, rounded)
    signed = torch.where(bits >= 0x8000, bits - 0x10000, bits)  # int16 holds the same 16 bits
    return signed.to(torch.int16).view(torch.bfloat16)


def _sweep() -> torch.Tensor:
    g = torch.Generator().manual_seed(0)
    # Every e4m3 value, the midpoints between neighbours (ties), and wide random magnitudes.
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(torch.float8_e4m3fn).float()
    codes = codes[codes.isfinite()].sort().values
    mids = (codes[1:] + codes[:-1]) / 2
    rand = torch.randn(200_000, generator=g) * torch.exp2(torch.randint(-14, 10, (200_000,), generator=g).float())
    return torch.cat([codes, mids, mids.nextafter(torch.tensor(1e9)), mids.nextafter(torch.tensor(-1e9)), rand,
                      torch.tensor([500.0, -1e6, 448.0, 464.0, 2.0**-10, -0.0])])


def test_fp8_encode_matches_torch_cast() -> None:
    v = _sweep()
    expected = v.clamp(-448, 448).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(_fp8_encode_like_kernel(v), expected)


def test_fp8_decode_matches_torch_for_every_code() -> None:
    codes = torch.arange(256, dtype=torch.int32).to(torch.uint8)
    ours, theirs = _fp8_decode_like_kernel(codes), codes.view(torch.float8_e4m3fn).float()
    assert torch.equal(ours.isnan(), theirs.isnan())
    finite = ~theirs.isnan()
    assert torch.equal(ours[finite], theirs[finite])
    assert torch.equal(ours[finite].sign(), theirs[finite].sign())


def test_bf16_store_matches_torch_round_to_nearest_even() -> None:
    v = _sweep() * 1.2345
    assert torch.equal(_bf16_store_like_kernel(v).view(torch.int16), v.to(torch.bfloat16).view(torch.int16))
