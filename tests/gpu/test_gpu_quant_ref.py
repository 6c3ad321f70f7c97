"""quantize_ref / dequantize_ref: the error bounds the codecs promise, on random and outlier-heavy
KV in every dtype, fp8's 448 ceiling, zero rows, and the bfloat16 scale rounding."""
from __future__ import annotations

import pytest
import torch

from kvstore.gpu.quant import bf16_round_up, dequantize_ref, quantize_ref

DTYPES = [torch.float16, torch.bfloat16, torch.float32]
# Half an ulp of the output dtype, relative: dequantize rounds x' = q * scale into it.
HALF_ULP = {torch.float16: 2.0**-11, torch.bfloat16: 2.0**-8, torch.float32: 2.0**-24}


def _kv(kind: str, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(2, 2, 16, 4, 128, generator=g)  # (L, 2, n, H, D)
    if kind == "outliers":
        # K's few huge channels (massive activations) plus sparse spikes and tiny-magnitude rows.
        x[..., 7] *= 300.0
        x[..., 100] *= -80.0
        spikes = torch.rand(x.shape, generator=g) < 0.002
        x = torch.where(spikes, x * 30.0, x)  # stays finite in float16 (|x| < 65504)
        x[:, :, 3] *= 1e-4
    out = x.to(dtype)
    assert out.isfinite().all()
    return out


@pytest.mark.parametrize("kind", ["random", "outliers"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_int8_error_at_most_half_a_step(kind: str, dtype: torch.dtype) -> None:
    x = _kv(kind, dtype)
    q, scale = quantize_ref(x, "int8")
    assert q.dtype == torch.int8 and scale.shape == x.shape[:-1] and scale.dtype == torch.bfloat16
    s = scale.float().unsqueeze(-1)
    err32 = (dequantize_ref(q, scale, torch.float32) - x.float()).abs()
    assert (err32 <= s / 2).all()
    back = dequantize_ref(q, scale, dtype).float()
    assert (back - x.float()).abs().le(s / 2 + back.abs() * HALF_ULP[dtype]).all()
    # The scale is at most one bfloat16 step above amax / 127: resolution is not wasted.
    amax = x.float().abs().amax(-1)
    assert (scale.float() >= amax / 127).all() and (scale.float() <= amax / 127 * (1 + 2**-7)).all()


@pytest.mark.parametrize("kind", ["random", "outliers"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_fp8_relative_error_for_normals(kind: str, dtype: torch.dtype) -> None:
    x = _kv(kind, dtype)
    q, scale = quantize_ref(x, "fp8")
    assert q.dtype == torch.float8_e4m3fn
    assert q.float().abs().max() <= 448 and not q.float().isnan().any()
    s = scale.float().unsqueeze(-1)
    xf = x.float()
    back32 = dequantize_ref(q, scale, torch.float32)
    normal = xf.abs() >= s * 2.0**-6
    err = (back32 - xf).abs()
    assert (err[normal] <= 2.0**-4 * xf.abs()[normal]).all()  # tighter than the 2^-3 target
    assert (err[~normal] <= (s * 2.0**-10).expand_as(xf)[~normal]).all()
    back = dequantize_ref(q, scale, dtype).float()
    assert ((back - xf).abs()[normal] <= ((2.0**-4 + HALF_ULP[dtype] * 1.1) * xf.abs())[normal]).all()


def test_fp8_row_max_maps_near_448_and_never_beyond() -> None:
    x = torch.tensor([[448.0, -1.0, 3.0, 0.5], [1e4, -2e4, 0.0, 7.0], [-3e-3, 1e-3, 0.0, 0.0]])
    q, scale = quantize_ref(x, "fp8")
    qa = q.float().abs().amax(-1)
    assert (qa <= 448).all() and (qa >= 416).all()  # 416 = the e4m3 value below 448
    assert torch.equal(quantize_ref(x, "fp8")[0].view(torch.uint8), q.view(torch.uint8))  # deterministic


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_zero_rows_stay_zero(fmt: str) -> None:
    x = torch.zeros(3, 5, 64, dtype=torch.float16)
    x[1, 2, 3] = 1.5
    q, scale = quantize_ref(x, fmt)
    back = dequantize_ref(q, scale, torch.float16)
    assert scale[0].float().eq(0).all() and back[0].eq(0).all()
    bound = float(scale[1, 2]) / 2 if fmt == "int8" else 1.5 * 2**-4
    assert abs(float(back[1, 2, 3]) - 1.5) <= bound + 1.5 * 2**-11
    assert back[1, 2].count_nonzero() == 1


def test_bf16_round_up_is_the_smallest_bfloat16_at_or_above() -> None:
    x = torch.tensor([0.0, 1.0, 1.0 + 2**-20, 3.14159, 1e-30, 6e4, 2.5e-6, 1e-40])
    up = bf16_round_up(x)
    assert (up.float() >= x).all()
    below = (up.view(torch.int16) - 1).view(torch.bfloat16).float()  # the bfloat16 just below
    assert (below[x > 0] < x[x > 0]).all()
    assert up[0] == 0 and up[1] == 1 and up[2] > 1


def test_invalid_arguments_are_named() -> None:
    with pytest.raises(ValueError, match="fmt"):
        quantize_ref(torch.zeros(2, 4), "int4")
    with pytest.raises(ValueError, match="x: dtype"):
        quantize_ref(torch.zeros(2, 4, dtype=torch.int32), "int8")
    with pytest.raises(ValueError, match="q: dtype"):
        dequantize_ref(torch.zeros(2, 4), torch.zeros(2, dtype=torch.bfloat16), torch.float16)
