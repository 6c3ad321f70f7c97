"""tiers.gpu without a GPU: it imports, and asking for one fails at construction saying why."""
from __future__ import annotations

import pytest
import torch

import kvstore.tiers.gpu as gpu_tier


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_gpu_tier_without_cuda_names_gpu_bytes() -> None:
    with pytest.raises(gpu_tier.GPUUnavailable, match=r"gpu_bytes.*needs a usable CUDA GPU"):
        gpu_tier.GPUTier(1 << 20)


def test_cpu_device_is_refused() -> None:
    with pytest.raises(ValueError, match="CUDA device"):
        gpu_tier.GPUTier(1 << 20, device="cpu")


def test_slots_are_aligned_for_vector_copies() -> None:
    assert gpu_tier.GPUTier.slot_bytes(1) == gpu_tier.SLOT_ALIGN_BYTES
    assert gpu_tier.GPUTier.slot_bytes(3 * gpu_tier.SLOT_ALIGN_BYTES) == 3 * gpu_tier.SLOT_ALIGN_BYTES
