"""Quantizing page codecs, `int8` and `fp8`, registered into `kvstore.codecs.CODECS` on import.

Encoded layout of the KV of n tokens (compact: a tail page is just a smaller n):

    [ q:     (L, 2, n, H, D)  int8 or float8_e4m3fn   L*2*n*H*D bytes ]
    [ scale: (L, 2, n, H)     bfloat16                L*2*n*H*2 bytes ]

one scale per token per head of each layer's K and V (`gpu.quant` explains the scheme). So a
page takes (D + 2) / (D * itemsize) of its raw bytes: with float16 KV, (D + 2) / 2D, so the CPU
tier holds close to twice as many pages in the same `cpu_bytes`, the closer the larger head_dim.

CUDA tensors are (de)quantized on their device by the CUDA kernels when CuPy is there, and by the
torch reference on that device otherwise; CPU tensors by the torch reference. When the KV and the
encoded bytes are on different devices, encoding happens on the KV's device and decoding on the
output's device, so only the compact bytes cross PCIe (half the bytes of float16 KV for int8).
"""
from __future__ import annotations

import torch

from kvstore.gpu import quant
from kvstore.gpu.runtime import kernels_available
from kvstore.codecs import CODECS
from kvstore.gpu.dtypes import KV_DTYPES
from kvstore.config import ModelSpec

_SCALE_BYTES = quant.SCALE_DTYPE.itemsize


class _QuantCodec:
    name: str
    fmt: str

    def encoded_bytes(self, spec: ModelSpec, num_tokens: int) -> int:
        return spec.num_layers * 2 * num_tokens * spec.num_kv_heads * (spec.head_dim + _SCALE_BYTES)

    def _split(self, spec: ModelSpec, data: torch.Tensor, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(q bytes, scale bytes) of an encoded page, both 1-D uint8 views into `data`."""
        expected = self.encoded_bytes(spec, num_tokens)
        if data.dtype != torch.uint8 or data.dim() != 1 or data.numel() != expected:
            raise ValueError(f"{self.name} codec: expected {expected} uint8 bytes for {num_tokens} tokens, "
                             f"got {data.dtype} of shape {tuple(data.shape)}")
        q_bytes = spec.num_layers * 2 * num_tokens * spec.num_kv_heads * spec.head_dim
        return data[:q_bytes], data[q_bytes:]

    def encode(self, spec: ModelSpec, kv: torch.Tensor, out: torch.Tensor) -> None:
        n = kv.shape[2] if kv.dim() == 5 else -1
        if tuple(kv.shape) != spec.kv_shape(max(n, 0)) or kv.dtype != KV_DTYPES[spec.dtype]:
            raise ValueError(f"{self.name} codec: kv must be (L, 2, n, H, D) = {spec.kv_shape(max(n, 0))} "
                             f"{spec.dtype}, got {tuple(kv.shape)} {kv.dtype}")
        if out.device != kv.device:  # quantize where the KV is, then move the compact bytes
            staged = torch.empty(out.shape, dtype=torch.uint8, device=kv.device)  # (encoded_bytes,)
            self.encode(spec, kv, staged)
            out.copy_(staged)
            return
        q_bytes, s_bytes = self._split(spec, out, n)
        q_view = q_bytes.view(quant.Q_DTYPES[self.fmt]).view(kv.shape)  # (L, 2, n, H, D)
        s_view = _try_view(s_bytes, quant.SCALE_DTYPE, kv.shape[:-1])   # (L, 2, n, H) or None
        if kv.is_cuda and kernels_available():
            if s_view is not None:
                quant.quantize(kv, self.fmt, q_out=q_view, scale_out=s_view)
                return
            q, scale = quant.quantize(kv, self.fmt, q_out=q_view)
        else:
            q, scale = quant.quantize_ref(kv, self.fmt)
            q_view.copy_(q)
        s_bytes.copy_(scale.contiguous().view(torch.uint8).view(-1))  # bytes: works at any alignment

    def decode(self, spec: ModelSpec, data: torch.Tensor, num_tokens: int, out: torch.Tensor) -> None:
        shape = spec.kv_shape(num_tokens)
        if tuple(out.shape) != shape or out.dtype != KV_DTYPES[spec.dtype]:
            raise ValueError(f"{self.name} codec: out must be {shape} {spec.dtype}, got {tuple(out.shape)} {out.dtype}")
        if data.device != out.device:
            data = data.to(out.device)  # the compact bytes cross, not the dequantized KV
        q_bytes, s_bytes = self._split(spec, data, num_tokens)
        q = q_bytes.view(quant.Q_DTYPES[self.fmt]).view(shape)  # (L, 2, n, H, D)
        scale = _try_view(s_bytes, quant.SCALE_DTYPE, shape[:-1])
        if scale is None:  # scales at an odd byte offset: realign with one small copy
            scale = _try_view(s_bytes.clone(), quant.SCALE_DTYPE, shape[:-1])
            assert scale is not None
        if out.is_cuda and kernels_available():
            if out.is_contiguous():
                quant.dequantize(q, scale, self.fmt, out.dtype, out=out)
            else:
                out.copy_(quant.dequantize(q, scale, self.fmt, out.dtype))
        else:
            out.copy_(quant.dequantize_ref(q, scale, out.dtype))


def _try_view(data: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
    """`data` (1-D uint8) reinterpreted as `dtype` of `shape`, or None when it is misaligned."""
    if data.data_ptr() % dtype.itemsize:
        return None
    try:
        return data.view(dtype).view(shape)
    except RuntimeError:
        return None


class Int8Codec(_QuantCodec):
    """int8, symmetric, one bfloat16 scale per token per head (scale = amax / 127, rounded up).

    Error bound per element: |x - x'| <= scale / 2 computed in float32, plus the rounding of x' to
    the KV dtype (half an ulp: 2^-11 |x'| for float16, 2^-8 |x'| for bfloat16). Zeros stay zeros.
    """

    name = "int8"
    fmt = "int8"


class FP8Codec(_QuantCodec):
    """fp8 e4m3 (max 448), one bfloat16 scale per token per head (scale = amax / 448, rounded up).

    Error bound per element: |x - x'| <= 2^-4 |x| where |x| >= scale * 2^-6 (the e4m3 normals),
    else |x - x'| <= scale * 2^-10; plus the rounding of x' to the KV dtype
    as for int8. Nothing saturates: |x| / scale <= 448 by construction.
    """

    name = "fp8"
    fmt = "fp8"


CODECS["int8"] = Int8Codec()
CODECS["fp8"] = FP8Codec()
