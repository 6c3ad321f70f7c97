"""The vLLM connector's layouts for the GPU attention backends (FLASH_ATTN and FLASHINFER: each
layer a logical (num_blocks, H, B, 2D) view, stored NHD or HND) on CUDA tensors, built without
vLLM: scatter, scatter_runs (a hit's pages from host memory) and gather move exactly the named
blocks, and leave on the device bit for bit what the same calls leave on CPU tensors
(tests/integrations/test_paged_layout.py checks the CPU side against the kernels' reading)."""
from __future__ import annotations

import pytest
import torch

from kvstore.integrations.backend_layouts import layout_for

pytestmark = pytest.mark.gpu
B, H, D, N = 16, 8, 128, 40  # vLLM's default FLASH_ATTN block size; a Llama-8B layer's KV heads and head size
BLOCKS = [31, 2, 17, 5, 38]


def _layer(physical: str, dtype: torch.dtype, device: str, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(logical (N, H, B, 2D) view, its storage) filled with random values: blocks not named
    must keep theirs."""
    g = torch.Generator().manual_seed(seed)
    shape = (N, B, H, 2 * D) if physical == "NHD" else (N, H, B, 2 * D)
    storage = torch.randn(shape, generator=g).to(dtype).to(device)
    return (storage.permute(0, 2, 1, 3) if physical == "NHD" else storage), storage


@pytest.mark.parametrize("backend", ["FLASH_ATTN", "FLASHINFER"])
@pytest.mark.parametrize("physical", ["NHD", "HND"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_cuda_layouts_match_the_cpu_reference(backend: str, physical: str, dtype: torch.dtype) -> None:
    layout = layout_for(backend, block_size=B, num_kv_heads=H, head_dim=D, dtype=dtype, kv_cache_layout=physical)
    ref_layer, ref_storage = _layer(physical, dtype, "cpu", seed=1)
    layer, storage = _layer(physical, dtype, "cuda", seed=1)
    ids = torch.tensor(BLOCKS)
    kv = torch.randn((2, len(BLOCKS) * B, H, D), generator=torch.Generator().manual_seed(2)).to(dtype)  # (2, T, H, D)
    layout.scatter(ref_layer, ids, kv)
    layout.scatter(layer, ids.cuda(), kv.cuda())
    assert torch.equal(storage.cpu().view(torch.int16), ref_storage.view(torch.int16))
    assert torch.equal(layout.gather(layer, ids.cuda()).cpu().view(torch.int16), kv.view(torch.int16))
    out = torch.empty((2, 2 * B, H, D), dtype=dtype, device="cuda")
    assert layout.gather(layer, ids[1:3].cuda(), out=out) is out
    assert torch.equal(out.cpu().view(torch.int16), kv[:, B:3 * B].view(torch.int16))

    # A hit as an in-process store serves it: runs of (k, 2, P, H, D) pages in host memory, here
    # with pages half a block long, joined on the device layer by layer.
    P = B // 2
    pages = kv.view(2, -1, P, H, D).transpose(0, 1).contiguous()  # (pages, 2, P, H, D)
    runs = [(0, pages[:3]), (3 * P, pages[3:])]
    ref_layer, ref_storage = _layer(physical, dtype, "cpu", seed=3)
    layer, storage = _layer(physical, dtype, "cuda", seed=3)
    layout.scatter_runs(ref_layer, ids, runs)
    layout.scatter_runs(layer, ids.cuda(), runs)
    assert torch.equal(storage.cpu().view(torch.int16), ref_storage.view(torch.int16))
    assert torch.equal(layout.gather(layer, ids.cuda()).cpu().view(torch.int16), kv.view(torch.int16))
