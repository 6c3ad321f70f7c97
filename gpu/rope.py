"""RoPE for cached K: apply the rotation at given positions (`apply_rope_ref`) and re-rotate K
computed at positions p to positions p + delta (`rope_rerotate`, `rope_rerotate_ref`) — what
CacheBlend does to a chunk's K when the chunk moves. The kernel is beside its reference.

RoPE rotates each pair of K's channels by `position * inv_freq[i]`; rotations compose, so
R(p + delta) = R(delta) R(p) and re-rotation is RoPE applied at positions `delta`. That holds as
long as `inv_freq` does not depend on the sequence: true for the default RoPE and for HF's
`linear` and `llama3` scalings (which only change `inv_freq`), false for `dynamic` (NTK base
grows with the sequence length) and `longrope` (short/long factors switch with the length), and
`yarn` also rescales cos/sin (attention factor), so those raise `RopeScalingUnsupported`.

Styles: `neox` (HF Llama's `rotate_half`: channel i pairs with i + D/2) and `gptj` (channel 2i
pairs with 2i + 1). `inv_freq` is computed as HF does (float32), angles in float64 so that large
positions keep their precision, and the rotation itself in float32.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import torch

from kvstore.gpu import runtime
from kvstore.gpu.dtypes import KV_DTYPE_NAMES, KV_DTYPES

STYLES = ("neox", "gptj")
SHIFT_INVARIANT_SCALINGS = ("default", "linear", "llama3")
_THREADS = 128
_MAX_GRID_Y = 65535


def kernel_names() -> set[str]:
    """Every kernel of kernels.cu `rope_rerotate` may launch: one per KV dtype."""
    return {_kernel(dtype) for dtype in KV_DTYPES.values()}


def _kernel(dtype: torch.dtype) -> str:
    return f"rope_rerotate_{KV_DTYPE_NAMES[dtype]}"


class RopeScalingUnsupported(ValueError):
    """This rope_scaling makes the rotation depend on more than the position shift."""


def _scaling_kind(rope_scaling: Mapping[str, Any] | None) -> str:
    if not rope_scaling:
        return "default"
    return str(rope_scaling.get("rope_type", rope_scaling.get("type", "default")))


def inv_freq(head_dim: int, theta: float, rope_scaling: Mapping[str, Any] | None = None) -> torch.Tensor:
    """(head_dim // 2,) float32 rotation frequencies, as HF transformers computes them: the one
    implementation, shared by the decode loop's RoPE (decode/rope.py) and re-rotation here."""
    if head_dim < 2 or head_dim % 2:
        raise ValueError(f"head_dim: RoPE needs an even head_dim >= 2, got {head_dim}")
    kind = _scaling_kind(rope_scaling)
    scaling: Mapping[str, Any] = rope_scaling or {}  # kind "default" when there is none
    if kind not in SHIFT_INVARIANT_SCALINGS:
        raise RopeScalingUnsupported(
            f"rope_scaling: {kind!r} RoPE is not a pure position shift (it depends on the sequence length "
            f"or rescales cos/sin), so cached K cannot be re-rotated; supported: {', '.join(SHIFT_INVARIANT_SCALINGS)}")
    # On the CPU whatever the default device: a decode model built on the meta device keeps real
    # frequencies (callers move them where the rotation runs).
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    freq = 1.0 / (theta ** exponents)  # (D/2,)
    if kind == "linear":
        freq = freq / float(scaling["factor"])
    elif kind == "llama3":
        freq = _llama3(freq, scaling)
    return freq


def _llama3(freq: torch.Tensor, cfg: Mapping[str, Any]) -> torch.Tensor:
    """HF's `_compute_llama3_parameters`: slow frequencies / factor, fast kept, a smooth blend between."""
    factor, low, high = float(cfg["factor"]), float(cfg["low_freq_factor"]), float(cfg["high_freq_factor"])
    old_len = float(cfg["original_max_position_embeddings"])
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / freq
    scaled = torch.where(wavelen > low_wavelen, freq / factor, freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
    return torch.where(medium, smoothed, scaled)


def rope_cos_sin(positions: torch.Tensor, freq: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin), each (T, D/2) float32, of angles positions[t] * freq[i] taken in float64."""
    angles = positions.to(torch.float64).unsqueeze(-1) * freq.to(torch.float64)  # (T, D/2)
    return angles.cos().float(), angles.sin().float()


def _positions(value: int | torch.Tensor, T: int, device: torch.device, name: str) -> torch.Tensor:
    pos = torch.as_tensor(value, device=device)
    if pos.dtype.is_floating_point or pos.dtype.is_complex or pos.dtype == torch.bool:
        raise ValueError(f"{name}: expected integer positions, got {pos.dtype}")
    if pos.dim() == 0:
        pos = pos.expand(T)
    if tuple(pos.shape) != (T,):
        raise ValueError(f"{name}: expected an int or a (T={T},) tensor, got shape {tuple(pos.shape)}")
    return pos


def _check(x: torch.Tensor, style: str, name: str) -> None:
    if style not in STYLES:
        raise ValueError(f"style: must be one of {', '.join(STYLES)}; got {style!r}")
    if x.dtype not in KV_DTYPE_NAMES:
        raise ValueError(f"{name}: dtype must be one of {', '.join(KV_DTYPES)}, got {x.dtype}")
    if x.dim() < 3:
        raise ValueError(f"{name}: expected (..., T, H, D), got shape {tuple(x.shape)}")


def _rotate_ref(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, style: str) -> torch.Tensor:
    """x (..., T, H, D) rotated by per-token (T, D/2) cos/sin, in float32, back in x's dtype."""
    xf = x.float()
    c, s = cos.unsqueeze(-2), sin.unsqueeze(-2)  # (T, 1, D/2): broadcast over heads
    half = x.shape[-1] // 2
    x1, x2 = (xf[..., :half], xf[..., half:]) if style == "neox" else (xf[..., 0::2], xf[..., 1::2])
    y1 = x1 * c - x2 * s  # separate multiply and subtract: the kernel rounds the same way
    y2 = x2 * c + x1 * s
    y = torch.cat([y1, y2], dim=-1) if style == "neox" else torch.stack([y1, y2], dim=-1).flatten(-2)
    return y.to(x.dtype)


def apply_rope_ref(x: torch.Tensor, positions: int | torch.Tensor, *, theta: float, style: str,
                   rope_scaling: Mapping[str, Any] | None = None) -> torch.Tensor:
    """RoPE of x (..., T, H, D) at `positions` (an int for all tokens, or (T,) ints)."""
    return _rope_ref(x, positions, "positions", theta, style, rope_scaling)


def _rope_ref(x: torch.Tensor, positions: int | torch.Tensor, name: str, theta: float, style: str,
              rope_scaling: Mapping[str, Any] | None) -> torch.Tensor:
    _check(x, style, "x")
    T, D = x.shape[-3], x.shape[-1]
    cos, sin = rope_cos_sin(_positions(positions, T, x.device, name), inv_freq(D, theta, rope_scaling).to(x.device))
    return _rotate_ref(x, cos, sin, style)


def rope_rerotate_ref(k: torch.Tensor, delta: int | torch.Tensor, *, theta: float, style: str,
                      rope_scaling: Mapping[str, Any] | None = None) -> torch.Tensor:
    """K (..., T, H, D) rotated at positions p -> the same K rotated at p + delta (int or (T,))."""
    return _rope_ref(k, delta, "delta", theta, style, rope_scaling)


def rope_rerotate(k: torch.Tensor, delta: int | torch.Tensor, *, theta: float, style: str,
                  rope_scaling: Mapping[str, Any] | None = None, out: torch.Tensor | None = None) -> torch.Tensor:
    """CUDA `rope_rerotate_ref`. `k` (..., T, H, D) on a CUDA device whose (T, H, D) block is
    contiguous and whose leading dims flatten to one stride (e.g. `kv[:, 0]` of (L, 2, T, H, D)),
    otherwise it is copied first. `out` may be `k` itself (in place) or another such tensor."""
    _check(k, style, "k")
    if k.device.type != "cuda":
        raise ValueError(f"k: the CUDA kernel needs a CUDA tensor, got {k.device} (use rope_rerotate_ref)")
    T, H, D = k.shape[-3:]
    freq = _device_freq(D, theta, rope_scaling, k.device)
    cos, sin = rope_cos_sin(_positions(delta, T, k.device, "delta"), freq)  # (T, D/2) each
    if out is None:
        out = torch.empty(k.shape, dtype=k.dtype, device=k.device)  # (..., T, H, D)
    elif tuple(out.shape) != tuple(k.shape) or out.dtype != k.dtype or out.device != k.device:
        raise ValueError(f"out: expected {tuple(k.shape)} {k.dtype} on {k.device}, "
                         f"got {tuple(out.shape)} {out.dtype} on {out.device}")
    src, dst = _batched(k), _batched(out)
    if dst is None:
        raise ValueError("out: its (T, H, D) block must be contiguous with leading dims of one stride")
    if src is None:
        src = _batched(k.contiguous())
        assert src is not None
    B = src.shape[0]
    if B == 0 or T * H == 0:
        return out
    tpr = min(_THREADS, 1 << (D // 2 - 1).bit_length())
    rpb = _THREADS // tpr
    blocks_x = (T * H + rpb - 1) // rpb
    for b0 in range(0, B, _MAX_GRID_Y):  # grid.y is limited; a (L, T, H, D) K never reaches it
        b1 = min(B, b0 + _MAX_GRID_Y)
        runtime.launch(_kernel(k.dtype), k.device, (blocks_x, b1 - b0, 1), (tpr, rpb, 1),
                       (runtime.ptr(src[b0]), runtime.ptr(dst[b0]),
                        runtime.i64(src.stride(0)), runtime.i64(dst.stride(0)),
                        runtime.i32(T), runtime.i32(H), runtime.i32(D), runtime.ptr(cos), runtime.ptr(sin),
                        runtime.i32(int(style == "neox"))))
    return out


# inv_freq on each device it was asked for: built on the CPU and copied over, which on a GPU costs
# more host time than the rotation's own launch (docs/performance.md "GPU kernels").
_device_freqs: dict[tuple[int, float, str, str], torch.Tensor] = {}


def _device_freq(head_dim: int, theta: float, rope_scaling: Mapping[str, Any] | None,
                 device: torch.device) -> torch.Tensor:
    key = (head_dim, float(theta), repr(sorted((rope_scaling or {}).items())), str(device))
    freq = _device_freqs.get(key)
    if freq is None:
        if len(_device_freqs) >= 64:  # a process serves a handful of models
            _device_freqs.clear()
        freq = inv_freq(head_dim, theta, rope_scaling).to(device)
        _device_freqs[key] = freq
    return freq


def _batched(x: torch.Tensor) -> torch.Tensor | None:
    """x as a (B, T, H, D) view with contiguous (T, H, D) rows, or None if no such view exists."""
    T, H, D = x.shape[-3:]
    if x.stride()[-3:] != (H * D, D, 1):
        return None
    try:
        return x.view(-1, T, H, D)
    except RuntimeError:
        return None
