"""KV tensors for the tests: random KV of a model spec, the same for the same seed in every test."""
from __future__ import annotations

import torch

from kvstore import ModelSpec
from kvstore.gpu.dtypes import KV_DTYPES


def random_kv(spec: ModelSpec, num_tokens: int, seed: int = 0) -> torch.Tensor:
    """(L, 2, T, H, D) standard normal values in the spec's dtype."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(spec.kv_shape(num_tokens), generator=gen).to(KV_DTYPES[spec.dtype])  # (L, 2, T, H, D)
