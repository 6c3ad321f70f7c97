"""gather_pages_ref / scatter_pages_ref: both engine layouts, tail pages, validation."""
from __future__ import annotations

import pytest
import torch

from kvstore.gpu.paged import gather_pages, gather_pages_ref, scatter_pages_ref

L, P, H, D, NB = 3, 4, 2, 8, 9


def _blocked(dtype: torch.dtype = torch.float16) -> torch.Tensor:
    return torch.randn(NB, L, 2, P, H, D).to(dtype)  # (num_blocks, L, 2, P, H, D)


def _per_layer(cache: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    # The same contents as independent contiguous per-layer tensors (num_blocks, P, H, D).
    return ([cache[:, layer, 0].contiguous() for layer in range(L)],
            [cache[:, layer, 1].contiguous() for layer in range(L)])


@pytest.mark.parametrize("num_tokens", [12, 10, 9])  # full pages and two tails
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_gather_matches_manual_indexing(num_tokens: int, dtype: torch.dtype) -> None:
    cache = _blocked(dtype)
    ids = [7, 0, 4]
    kv = gather_pages_ref(cache, ids, num_tokens)
    assert kv.shape == (L, 2, num_tokens, H, D) and kv.dtype == dtype and kv.is_contiguous()
    for t in range(num_tokens):
        assert torch.equal(kv[:, :, t], cache[ids[t // P], :, :, t % P])
    assert torch.equal(gather_pages_ref(_per_layer(cache), ids, num_tokens), kv)


@pytest.mark.parametrize("layout", ["blocked", "per_layer"])
@pytest.mark.parametrize("num_tokens", [12, 10])
def test_scatter_then_gather_roundtrip_leaves_other_slots(layout: str, num_tokens: int) -> None:
    blocked = torch.zeros(NB, L, 2, P, H, D)
    cache = blocked if layout == "blocked" else _per_layer(blocked)
    kv = torch.randn(L, 2, num_tokens, H, D)
    ids = torch.tensor([5, 2, 8], dtype=torch.int32)
    scatter_pages_ref(kv, cache, ids)
    assert torch.equal(gather_pages_ref(cache, ids, num_tokens), kv)
    # Nothing outside the written tokens changed: untouched blocks and the tail's unused slots.
    full = gather_pages_ref(cache, torch.arange(NB))  # (L, 2, NB*P, H, D)
    written = {ids[t // P].item() * P + t % P for t in range(num_tokens)}
    untouched = [i for i in range(NB * P) if i not in written]
    assert torch.count_nonzero(full[:, :, untouched]) == 0


def test_validation_names_the_problem() -> None:
    cache = _blocked()
    with pytest.raises(IndexError, match="block_ids"):
        gather_pages_ref(cache, [0, NB])
    with pytest.raises(ValueError, match="num_tokens"):
        gather_pages_ref(cache, [0, 1], 4)  # 2 blocks must hold 5..8 tokens
    with pytest.raises(ValueError, match="block_ids"):
        gather_pages_ref(cache, torch.tensor([0.0, 1.0]))
    with pytest.raises(ValueError, match="distinct"):
        scatter_pages_ref(torch.zeros(L, 2, 8, H, D, dtype=torch.float16), cache, [3, 3])
    with pytest.raises(ValueError, match="kv"):
        scatter_pages_ref(torch.zeros(L, 2, 8, H, D + 1, dtype=torch.float16), cache, [3, 4])
    with pytest.raises(ValueError, match="dtype"):
        scatter_pages_ref(torch.zeros(L, 2, 8, H, D), cache, [3, 4])
    ks, vs = _per_layer(cache)
    with pytest.raises(ValueError, match="v_caches"):
        gather_pages_ref((ks, vs[:-1] + [vs[-1].float()]), [0])


def test_kernel_wrapper_rejects_cpu_tensors() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        gather_pages(_blocked(), [0, 1])
