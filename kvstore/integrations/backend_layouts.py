"""Which `PagedLayout` an attention backend's KV cache has, and which layer a cache belongs to.

vLLM hands the connector each layer's paged cache by the layer's module name, and says which
attention backend owns it; the worker needs both to read and write the store's (2, T, H, D)
pages into those blocks. A backend kvstore does not know is refused by name, never guessed.
"""
from __future__ import annotations

import re
from typing import Callable

import torch

from kvstore.integrations.paged_layout import (BackendWrittenLayout, BlockPermutationLayout, ContentSplitLayout,
                                               PagedLayout, StridedBlockLayout, UnsupportedLayout, probe_block_order)

# Backends whose per-layer cache is the logical (num_blocks, H, B, 2D) view with K then V in the
# last dim, in either physical order (NHD or HND): checked in their forward() of vLLM 0.32.
CONTENT_SPLIT_BACKENDS = ("FLASH_ATTN", "FLASHINFER")
CPU_BACKEND = "CPU_ATTN"
_LAYER_INDEX = re.compile(r"\.(\d+)\.")


def layer_index(name: str) -> int:
    """`model.layers.7.self_attn.attn` -> 7 (the store's layer index)."""
    found = _LAYER_INDEX.findall(name)
    if not found:
        raise UnsupportedLayout(f"{name}: cannot tell which layer this KV cache belongs to")
    return int(found[-1])


def layout_for(backend: str, *, block_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
               cpu_writer: Callable[[], Callable[..., None]] | None = None,
               kv_cache_layout: str | None = None) -> PagedLayout:
    """The `PagedLayout` of an attention backend, by its vLLM name; any other is refused by name."""
    if backend in CONTENT_SPLIT_BACKENDS:
        return ContentSplitLayout(f"{backend}/{kv_cache_layout or 'NHD'}", block_size, num_kv_heads, head_dim)
    if backend == CPU_BACKEND and cpu_writer is not None:
        write = cpu_writer()
        order = probe_block_order(write, block_size=block_size, num_kv_heads=num_kv_heads, head_dim=head_dim,
                                  dtype=dtype, name=backend)
        reader = StridedBlockLayout.from_order(f"{backend}/strided", block_size, num_kv_heads, head_dim, order) \
            or BlockPermutationLayout(f"{backend}/permuted", block_size, num_kv_heads, head_dim, order)
        return BackendWrittenLayout(reader, write)
    known = ", ".join((*CONTENT_SPLIT_BACKENDS, CPU_BACKEND))
    raise UnsupportedLayout(f"KVStoreConnector: attention backend {backend!r} has a paged KV layout kvstore does not "
                            f"know (known: {known})")
