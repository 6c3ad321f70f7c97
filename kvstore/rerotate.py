"""Moving a chunk's KV to new positions (CacheBlend): K re-rotated by RoPE, V unchanged.

A chunk is stored as computed standalone at positions 0..n-1; placed at `start` in a new prompt
its K must be rotated as if computed at start..start+n-1. RoPE rotations compose, so that is one
more rotation by `start` (gpu/rope.py: the CUDA kernel on a GPU, its torch reference elsewhere).
Attention sees only relative positions, so the moved KV is, to float rounding of the rotation
angles, the chunk's KV prefilled alone at its new positions, at every layer (docs/cacheblend.md).
This is exact only where the rotation depends on the position alone; `check_rerotatable` refuses
the rest (dynamic NTK, YaRN, LongRoPE) with `Unsupported` rather than return wrong KV.
It does not decide which chunks hit or what to recompute (the store and decode/blend.py do).
"""
from __future__ import annotations

from typing import Any

import torch

from kvstore.gpu.rope import RopeScalingUnsupported, inv_freq, rope_rerotate, rope_rerotate_ref
from kvstore.config import ModelSpec
from kvstore.errors import Unsupported


def check_rerotatable(spec: ModelSpec) -> None:
    """Raise `Unsupported` (HTTP 422) if cached K of this model cannot be moved exactly."""
    try:
        inv_freq(spec.head_dim, spec.rope_theta, spec.rope_scaling_dict)
    except RopeScalingUnsupported as exc:
        raise Unsupported(f"blend: chunk KV cannot be re-rotated for this model: {exc}", field="rope_scaling") from None


def rerotate_into(out: torch.Tensor, kv: torch.Tensor, spec: ModelSpec, delta: int) -> None:
    """Write `kv` (L, 2, n, H, D), K rotated at positions p, into `out` (same shape) with K
    rotated at p + delta."""
    assert out.shape == kv.shape and kv.shape[1] == 2, (out.shape, kv.shape)
    rope: dict[str, Any] = dict(theta=spec.rope_theta, style=spec.rope_style, rope_scaling=spec.rope_scaling_dict)
    out[:, 1].copy_(kv[:, 1])
    if delta == 0:
        out[:, 0].copy_(kv[:, 0])
    elif out.device.type == "cuda":
        k = out[:, 0]  # (L, n, H, D) view; the kernel rotates in place when the view allows it
        k.copy_(kv[:, 0])
        rope_rerotate(k, delta, out=k, **rope)
    else:
        out[:, 0].copy_(rope_rerotate_ref(kv[:, 0], delta, **rope))  # (L, n, H, D)
