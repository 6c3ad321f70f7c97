"""Deterministic KV for token sequences, so any process can tell right bytes from wrong ones.

The KV of token position i is a function of (token id, i) only: sequences that share a prefix
share its KV (as a real model's would), and a sequence of globally unique token ids has KV no
other sequence has. Values are small exact float16 numbers (no NaN: bit-exact comparison works).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from kvstore import ModelSpec

SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float16", page_size=16)  # 4 KiB pages


def expected_kv(spec: ModelSpec, tokens: list[int] | np.ndarray) -> torch.Tensor:
    """(L, 2, T, H, D) KV of `tokens`, a pure function of (token, position)."""
    toks = np.asarray(tokens, dtype=np.int64)
    pos = np.arange(toks.size, dtype=np.int64)
    L, _, T, H, D = spec.kv_shape(toks.size)
    lanes = np.arange(L * 2 * H * D, dtype=np.int64).reshape(L, 2, 1, H, D)
    mix = (toks * 2654435761 + pos * 40503)[None, None, :, None, None]  # (1, 1, T, 1, 1)
    x = (mix + lanes * 97) % 4093 - 2046  # (L, 2, T, H, D) ints in [-2046, 2046]
    dtype = {"float16": np.float16, "bfloat16": np.float32, "float32": np.float32}[spec.dtype]
    kv = torch.from_numpy((x / 256.0).astype(dtype))
    return kv.to(torch.bfloat16) if spec.dtype == "bfloat16" else kv


def served_wrong(spec: ModelSpec, tokens: list[int], result: Any) -> bool:
    """Whether a fetch of `tokens` (its `result`) served KV that is not theirs; a short match is not wrong."""
    n = result.matched_tokens
    return bool(n) and not torch.equal(result.kv, expected_kv(spec, tokens[:n]))
