"""RoPE references: rerotating K from p to p + delta equals RoPE at p + delta (1e-5 in float32),
for neox and gptj styles, default/linear/llama3 scaling, and the HF conventions of each style."""
from __future__ import annotations

import pytest
import torch

from kvstore.gpu.rope import RopeScalingUnsupported, apply_rope_ref, inv_freq, rope_rerotate, rope_rerotate_ref

THETA = 500000.0
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 8192}
SCALINGS = [None, {"type": "linear", "factor": 4.0}, LLAMA3]


def _k(T: int = 24, H: int = 3, D: int = 64, L: int = 2, seed: int = 0) -> torch.Tensor:
    return torch.randn(L, T, H, D, generator=torch.Generator().manual_seed(seed))  # (L, T, H, D)


@pytest.mark.parametrize("scaling", SCALINGS)
@pytest.mark.parametrize("style", ["neox", "gptj"])
@pytest.mark.parametrize("p0,delta", [(0, 37), (1000, 5000), (70000, -65000), (0, 131072)])
def test_rerotate_equals_rope_at_shifted_positions(style: str, scaling: dict | None, p0: int, delta: int) -> None:
    k = _k()
    T = k.shape[1]
    pos = torch.arange(T) + p0
    at_p = apply_rope_ref(k, pos, theta=THETA, style=style, rope_scaling=scaling)
    moved = rope_rerotate_ref(at_p, delta, theta=THETA, style=style, rope_scaling=scaling)
    direct = apply_rope_ref(k, pos + delta, theta=THETA, style=style, rope_scaling=scaling)
    assert (moved - direct).abs().max() <= 1e-5


@pytest.mark.parametrize("style", ["neox", "gptj"])
def test_per_token_deltas_and_inverse(style: str) -> None:
    k = _k(T=10)
    delta = torch.tensor([0, 1, 2, 3, 100, -5, 7, 7, 4096, 9])
    moved = rope_rerotate_ref(k, delta, theta=10000.0, style=style)
    for t in range(10):
        one = rope_rerotate_ref(k[:, t:t + 1], int(delta[t]), theta=10000.0, style=style)
        assert torch.equal(moved[:, t:t + 1], one)
    back = rope_rerotate_ref(moved, -delta, theta=10000.0, style=style)
    assert (back - k).abs().max() <= 1e-5
    assert torch.equal(rope_rerotate_ref(k, 0, theta=10000.0, style=style), k)


def _hf_neox(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    # transformers' Llama: cos = cat(freqs, freqs); x * cos + rotate_half(x) * sin.
    D = x.shape[-1]
    freqs = pos.double()[:, None] * inv_freq(D, theta).double()[None]
    emb = torch.cat([freqs, freqs], -1)
    cos, sin = emb.cos()[:, None], emb.sin()[:, None]
    rot = torch.cat([-x[..., D // 2:], x[..., :D // 2]], -1)
    return (x.double() * cos + rot.double() * sin).float()


def _hf_gptj(x: torch.Tensor, pos: torch.Tensor, theta: float) -> torch.Tensor:
    # transformers' GPT-J: sin/cos repeat_interleave(2); x * cos + rotate_every_two(x) * sin.
    freqs = pos.double()[:, None] * inv_freq(x.shape[-1], theta).double()[None]
    cos, sin = freqs.cos().repeat_interleave(2, -1)[:, None], freqs.sin().repeat_interleave(2, -1)[:, None]
    rot = torch.stack([-x[..., 1::2], x[..., 0::2]], -1).flatten(-2)
    return (x.double() * cos + rot.double() * sin).float()


@pytest.mark.parametrize("style,hf", [("neox", _hf_neox), ("gptj", _hf_gptj)])
def test_styles_follow_hf_conventions(style: str, hf) -> None:
    k = _k(T=16)
    pos = torch.arange(16) * 97
    assert (apply_rope_ref(k, pos, theta=10000.0, style=style) - hf(k, pos, 10000.0)).abs().max() <= 1e-5


def test_half_precision_rerotation_is_within_rounding() -> None:
    k = _k()
    for dtype, tol in ((torch.float16, 2e-2), (torch.bfloat16, 5e-2)):
        at_p = apply_rope_ref(k, torch.arange(24), theta=THETA, style="neox").to(dtype)
        moved = rope_rerotate_ref(at_p, 300, theta=THETA, style="neox")
        assert moved.dtype == dtype
        direct = apply_rope_ref(k, torch.arange(24) + 300, theta=THETA, style="neox")
        assert (moved.float() - direct).abs().max() <= tol


@pytest.mark.parametrize("kind", ["dynamic", "yarn", "longrope"])
def test_sequence_dependent_scalings_raise(kind: str) -> None:
    with pytest.raises(RopeScalingUnsupported, match=kind):
        rope_rerotate_ref(_k(), 5, theta=THETA, style="neox", rope_scaling={"rope_type": kind, "factor": 2.0})


def test_llama3_and_linear_change_inv_freq_like_hf() -> None:
    base = inv_freq(128, THETA)
    assert torch.allclose(inv_freq(128, THETA, {"type": "linear", "factor": 4.0}), base / 4)
    l3 = inv_freq(128, THETA, LLAMA3)
    assert torch.equal(l3[:8], base[:8])  # fast (short-wavelength) frequencies are kept
    assert torch.allclose(l3[-8:], base[-8:] / 8)  # slow ones are divided by the factor


def test_invalid_arguments() -> None:
    with pytest.raises(ValueError, match="style"):
        rope_rerotate_ref(_k(), 1, theta=THETA, style="llama")
    with pytest.raises(ValueError, match="delta"):
        rope_rerotate_ref(_k(), torch.tensor([1, 2]), theta=THETA, style="neox")
    with pytest.raises(ValueError, match="head_dim"):
        rope_rerotate_ref(torch.zeros(4, 2, 5), 1, theta=THETA, style="neox")
    with pytest.raises(ValueError, match="CUDA"):
        rope_rerotate(_k(), 1, theta=THETA, style="neox")
