"""Quantize KV to int8 or fp8 (e4m3) with one scale per row of D elements — per token per head,
for each layer's K and V — and back; each CUDA kernel beside its pure-torch reference.

Scheme (same in kernel and reference, operation by operation, so they agree bit for bit):
    amax  = max |x| over the row                    (float32)
    scale = bfloat16_round_up(amax / QMAX)          QMAX = 127 (int8) or 448 (e4m3 max)
    int8: q = clamp(round_half_even(x / scale), -127, 127)
    fp8:  q = e4m3fn(clamp(x / scale, -448, 448))   (round to nearest even, saturating)
    x'    = dtype(float32(q) * scale)
Scales are bfloat16 (2 bytes, so int8 pages of head_dim 128 take (128 + 2) / 256 of float16's
bytes) and rounded *up*: then |x| / scale <= QMAX always, nothing saturates, and the error
bounds below hold against the stored scale whatever the KV's range (float16 scales would overflow
for bfloat16/float32 KV above ~8e6 and lose digits below ~1e-5). A row of zeros gets scale 0.

Error bounds, for finite input, per element, before the final rounding to the output dtype
(which adds at most half an ulp of x': 2^-11 |x'| for float16, 2^-8 |x'| for bfloat16):
    int8: |x - x'| <= scale / 2, with scale <= amax / 127 * (1 + 2^-7)
    fp8:  |x - x'| <= 2^-4 |x|      where |x| / scale >= 2^-6 (e4m3 normals)
          |x - x'| <= scale * 2^-10 below that (e4m3 subnormals)
"""
from __future__ import annotations

import torch

from kvstore.gpu import runtime
from kvstore.gpu.dtypes import KV_DTYPE_NAMES, KV_DTYPES

FORMATS = ("int8", "fp8")
QMAX = {"int8": 127.0, "fp8": 448.0}
Q_DTYPES = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
SCALE_DTYPE = torch.bfloat16
_WARPS_PER_BLOCK = 8
VECTOR_WIDTHS = (4, 1)  # elements per lane: 4 where every row start is aligned for it, else 1
KINDS = ("quantize", "dequantize")


def kernel_names() -> set[str]:
    """Every kernel of kernels.cu these wrappers may launch: each kind, format, KV dtype and width."""
    return {_kernel(kind, fmt, dtype, vec) for kind in KINDS for fmt in FORMATS for dtype in KV_DTYPES.values()
            for vec in VECTOR_WIDTHS}


def _kernel(kind: str, fmt: str, dtype: torch.dtype, vec: int) -> str:
    return f"{kind}_{fmt}_{KV_DTYPE_NAMES[dtype]}_v{vec}"


def _check_format(fmt: str) -> None:
    if fmt not in FORMATS:
        raise ValueError(f"fmt: must be one of {', '.join(FORMATS)}; got {fmt!r}")


def _check_kv_dtype(dtype: torch.dtype, name: str) -> None:
    if dtype not in KV_DTYPE_NAMES:
        raise ValueError(f"{name}: dtype must be one of {', '.join(KV_DTYPES)}, got {dtype}")


def bf16_round_up(x: torch.Tensor) -> torch.Tensor:
    """Non-negative float32 -> the smallest bfloat16 >= x (truncate the low 16 bits, then step up
    one ulp if any were set; for positive floats the bit pattern orders like the value)."""
    bits = x.contiguous().view(torch.int32)
    up = (bits >> 16) + ((bits & 0xFFFF) != 0).to(torch.int32)
    return up.to(torch.int16).view(torch.bfloat16)


def quantize_ref(x: torch.Tensor, fmt: str) -> tuple[torch.Tensor, torch.Tensor]:
    """x (..., D) float16/bfloat16/float32 -> (q (..., D) int8 or float8_e4m3fn, scale (...) bfloat16)."""
    _check_format(fmt)
    _check_kv_dtype(x.dtype, "x")
    xf = x.float()  # (..., D)
    amax = xf.abs().amax(dim=-1)  # (...)
    # Divide by a tensor, not a Python number: on CUDA torch turns `t / number` into `t * (1 /
    # number)`, which is not IEEE division and moves some scales one bfloat16 step from the kernel's.
    scale = bf16_round_up(amax / torch.full_like(amax, QMAX[fmt]))  # (...)
    s = scale.float().unsqueeze(-1)  # (..., 1)
    v = torch.where(s > 0, xf / s, torch.zeros((), dtype=torch.float32, device=x.device))
    if fmt == "int8":
        q = v.round().clamp_(-127, 127).to(torch.int8)
    else:
        q = v.clamp_(-448.0, 448.0).to(torch.float8_e4m3fn)
    return q, scale


def dequantize_ref(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """(q (..., D) int8 or float8_e4m3fn, scale (...) bfloat16) -> x' (..., D) in `dtype`."""
    _check_kv_dtype(dtype, "dtype")
    if q.dtype not in Q_DTYPES.values():
        raise ValueError(f"q: dtype must be int8 or float8_e4m3fn, got {q.dtype}")
    return (q.float() * scale.float().unsqueeze(-1)).to(dtype)


# --- CUDA kernels ------------------------------------------------------------------------------

def _as_q(t: torch.Tensor, fmt: str, name: str) -> torch.Tensor:
    if t.dtype == torch.uint8:
        t = t.view(Q_DTYPES[fmt])
    if t.dtype != Q_DTYPES[fmt]:
        raise ValueError(f"{name}: expected {Q_DTYPES[fmt]} (or uint8) for {fmt}, got {t.dtype}")
    return t


def _check_out(t: torch.Tensor, shape: tuple[int, ...], device: torch.device, name: str) -> None:
    if tuple(t.shape) != shape or t.device != device or not t.is_contiguous():
        raise ValueError(f"{name}: expected a contiguous {shape} tensor on {device}, "
                         f"got {tuple(t.shape)} on {t.device} (contiguous={t.is_contiguous()})")


def _geometry(x_like: torch.Tensor, q: torch.Tensor, itemsize: int) -> tuple[int, int, int]:
    """(rows, D, VEC): 4 elements per lane when every row start is aligned for it."""
    D = x_like.shape[-1]
    rows = x_like.numel() // D if D else 0
    wide = VECTOR_WIDTHS[0]
    aligned = D % wide == 0 and x_like.data_ptr() % (wide * itemsize) == 0 and q.data_ptr() % wide == 0
    vec = wide if aligned else VECTOR_WIDTHS[-1]
    return rows, D, vec


def _launch(kind: str, fmt: str, dtype: torch.dtype, device: torch.device, rows: int, D: int, vec: int,
            args: tuple[torch.Tensor, torch.Tensor, torch.Tensor]) -> None:
    if rows == 0:
        return
    blocks = (rows + _WARPS_PER_BLOCK - 1) // _WARPS_PER_BLOCK
    runtime.launch(_kernel(kind, fmt, dtype, vec), device, (blocks, 1, 1),
                   (32 * _WARPS_PER_BLOCK, 1, 1), (*(runtime.ptr(a) for a in args), runtime.i64(rows), runtime.i32(D)))


def quantize(x: torch.Tensor, fmt: str, *, q_out: torch.Tensor | None = None,
             scale_out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """CUDA `quantize_ref`. x (..., D) on a CUDA device (copied once if not contiguous);
    `q_out` (..., D) int8/float8_e4m3fn/uint8 and `scale_out` (...) bfloat16, contiguous, if given."""
    _check_format(fmt)
    _check_kv_dtype(x.dtype, "x")
    if x.device.type != "cuda":
        raise ValueError(f"x: the CUDA kernel needs a CUDA tensor, got {x.device} (use quantize_ref)")
    if x.dim() == 0:
        raise ValueError("x: expected (..., D), got a scalar")
    x = x.contiguous()
    q = torch.empty(x.shape, dtype=Q_DTYPES[fmt], device=x.device) if q_out is None else _as_q(q_out, fmt, "q_out")
    _check_out(q, tuple(x.shape), x.device, "q_out")
    scale = torch.empty(x.shape[:-1], dtype=SCALE_DTYPE, device=x.device) if scale_out is None else scale_out
    _check_out(scale, tuple(x.shape[:-1]), x.device, "scale_out")
    if scale.dtype != SCALE_DTYPE:
        raise ValueError(f"scale_out: expected {SCALE_DTYPE}, got {scale.dtype}")
    rows, D, vec = _geometry(x, q, x.dtype.itemsize)
    _launch("quantize", fmt, x.dtype, x.device, rows, D, vec, (x, q, scale))
    return q, scale


def dequantize(q: torch.Tensor, scale: torch.Tensor, fmt: str, dtype: torch.dtype, *,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """CUDA `dequantize_ref`. q (..., D) int8/float8_e4m3fn/uint8 and scale (...) bfloat16 on one
    CUDA device; `out` (..., D) contiguous in `dtype`, if given."""
    _check_format(fmt)
    _check_kv_dtype(dtype, "dtype")
    q = _as_q(q, fmt, "q")
    if q.device.type != "cuda":
        raise ValueError(f"q: the CUDA kernel needs a CUDA tensor, got {q.device} (use dequantize_ref)")
    if q.dim() == 0:
        raise ValueError("q: expected (..., D), got a scalar")
    q = q.contiguous()
    if scale.dtype != SCALE_DTYPE:
        raise ValueError(f"scale: expected {SCALE_DTYPE}, got {scale.dtype}")
    if tuple(scale.shape) != tuple(q.shape[:-1]) or scale.device != q.device:
        raise ValueError(f"scale: expected {tuple(q.shape[:-1])} on {q.device}, "
                         f"got {tuple(scale.shape)} on {scale.device}")
    scale = scale.contiguous()
    x = torch.empty(q.shape, dtype=dtype, device=q.device) if out is None else out
    _check_out(x, tuple(q.shape), q.device, "out")
    if x.dtype != dtype:
        raise ValueError(f"out: expected {dtype}, got {x.dtype}")
    rows, D, vec = _geometry(x, q, dtype.itemsize)
    _launch("dequantize", fmt, dtype, q.device, rows, D, vec, (q, scale, x))
    return x
