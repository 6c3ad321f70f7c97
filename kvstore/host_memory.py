"""Host tensors backed by transparent huge pages, for the store's large CPU buffers.

A fetch returns a new tensor; filling fresh memory page-faults once per 4 KiB page, and that
dominated a large fetch (docs/performance.md has the figures).
Anonymous memory advised `MADV_HUGEPAGE` faults once per 2 MiB instead, which works whatever the
system's THP setting is short of `never`. Small tensors use torch's allocator as usual.
"""
from __future__ import annotations

import math
import mmap

import torch

HUGE_PAGE_BYTES = 2 << 20
MIN_HUGE_BYTES = 4 << 20  # below this the mmap call costs more than the faults it saves


def empty_host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype) on the CPU, in huge pages when it is large."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_HUGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    # Over-allocate so the tensor can start on a 2 MiB boundary: only aligned 2 MiB ranges
    # become huge pages. The tensor keeps the mapping alive; it is unmapped with the tensor.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = torch.frombuffer(region, dtype=torch.uint8)
    offset = (-raw.data_ptr()) % HUGE_PAGE_BYTES
    return raw[offset:offset + nbytes].view(dtype).view(shape)
