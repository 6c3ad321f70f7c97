"""Rotary position embedding (RoPE), neox style, with HF `rope_scaling` types linear and llama3.

Positions are always an explicit tensor: the prefix path passes `start..end-1`, and CacheBlend
passes whatever positions a chunk lands at. The inverse frequencies are computed exactly as
transformers computes them (float32, same formulas), so rotated K matches HF bit for bit in
float32 and K fetched from the store lines up with K computed here.
"""
from __future__ import annotations

import math
from typing import Any

import torch


def inverse_frequencies(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """(head_dim // 2,) float32 inverse frequencies, scaled per `scaling` (HF `rope_scaling`)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim))  # (D/2,)
    kind = "default" if scaling is None else scaling.get("rope_type", scaling.get("type", "default"))
    if kind == "default":
        return inv_freq
    if kind == "linear":
        # Dividing the frequencies equals dividing the positions (position interpolation).
        return inv_freq / float(scaling["factor"])
    if kind == "llama3":
        return _llama3(inv_freq, scaling)
    raise ValueError(f"rope_scaling.rope_type: {kind!r} is not supported (default, linear, llama3)")


def _llama3(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between blended.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling["low_freq_factor"])
    high_freq_factor = float(scaling["high_freq_factor"])
    old_context_len = scaling["original_max_position_embeddings"]
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context_len / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


class Rotary(torch.nn.Module):
    """Applies RoPE to q or k of shape (T, heads, D) at `positions` (T,)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        # A plain attribute, not a buffer: `model.to(bfloat16)` must not round the frequencies, and
        # an explicit CPU device keeps them real when the model is built on the meta device.
        self.inv_freq = inverse_frequencies(head_dim, theta, scaling)  # (D/2,) float32

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (T, 1, D): computed in float32 like HF, then cast to the model dtype."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @staticmethod
    def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # neox: rotate the two halves
        return x * cos + rotated * sin
