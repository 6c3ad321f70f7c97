"""Rotary position embedding (RoPE), neox style, with HF `rope_scaling` types linear and llama3.

Positions are always an explicit tensor: the prefix path passes `start..end-1`, and CacheBlend
passes whatever positions a chunk lands at. The inverse frequencies are `kvstore.gpu.rope.inv_freq`,
the one implementation (as transformers computes them: float32, same formulas) that the store's
re-rotation uses too, so rotated K matches HF bit for bit in float32 and K fetched from the store,
re-rotated or not, lines up with K computed here.
"""
from __future__ import annotations

from typing import Any

import torch

from kvstore.gpu.rope import inv_freq


class Rotary(torch.nn.Module):
    """Applies RoPE to q or k of shape (T, heads, D) at `positions` (T,)."""

    def __init__(self, head_dim: int, theta: float, scaling: dict[str, Any] | None):
        super().__init__()
        # A plain attribute, not a buffer: `model.to(bfloat16)` must not round the frequencies, and
        # an explicit CPU device keeps them real when the model is built on the meta device.
        self.inv_freq = inv_freq(head_dim, theta, scaling)  # (D/2,) float32, on the CPU

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin of shape (T, 1, D): computed in float32 like HF, then cast to the model dtype."""
        freqs = positions.to(torch.float32)[:, None] * self.inv_freq.to(positions.device)[None, :]  # (T, D/2)
        emb = torch.cat((freqs, freqs), dim=-1)  # (T, D)
        return emb.cos().to(dtype)[:, None, :], emb.sin().to(dtype)[:, None, :]

    @staticmethod
    def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)  # neox: rotate the two halves
        return x * cos + rotated * sin
