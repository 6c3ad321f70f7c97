"""Host tensors backed by transparent huge pages, for the store's large CPU buffers.

A fetch returns a new tensor; filling fresh memory page-faults once per 4 KiB page, and that
dominated a large fetch (docs/performance.md has the figures).
Anonymous memory advised `MADV_HUGEPAGE` faults once per 2 MiB instead, which works whatever the
system's THP setting is short of `never`. Small tensors use torch's allocator as usual.
"""
from __future__ import annotations

import math
import mmap

import numpy as np
import torch

HUGE_PAGE_BYTES = 2 << 20
MIN_HUGE_BYTES = 4 << 20  # below this the mmap call costs more than the faults it saves


def empty_host(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """torch.empty(shape, dtype) on the CPU, in huge pages when it is large."""
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes < MIN_HUGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return torch.empty(shape, dtype=dtype)
    return torch.from_numpy(empty_host_bytes(nbytes)).view(dtype).view(shape)


def empty_host_bytes(nbytes: int) -> np.ndarray:
    """A new uint8 numpy array of `nbytes`, in huge pages when it is large."""
    if nbytes < MIN_HUGE_BYTES or not hasattr(mmap, "MADV_HUGEPAGE"):
        return np.empty(nbytes, np.uint8)
    # Over-allocate so the array can start on a 2 MiB boundary: only aligned 2 MiB ranges
    # become huge pages. The array keeps the mapping alive; it is unmapped with the array.
    region = mmap.mmap(-1, nbytes + HUGE_PAGE_BYTES, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    raw = np.frombuffer(region, dtype=np.uint8)
    offset = (-raw.ctypes.data) % HUGE_PAGE_BYTES
    return raw[offset:offset + nbytes]
