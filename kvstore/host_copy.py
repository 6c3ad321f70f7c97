"""Host copies for the store's hot paths, done by numpy on the calling thread instead of torch's
intra-op thread pool.

torch parallelises a large CPU copy over its OpenMP threads. On a machine whose cores are busy
(a sidecar next to an engine, a shared CI box) a parallel region waits for descheduled threads,
and a small copy takes milliseconds instead of microseconds. numpy's copy is one memcpy-speed loop on
the calling thread and releases the GIL, so concurrent requests still copy in parallel. Device
copies go through torch as usual; dtypes numpy lacks (bfloat16) are copied as their bits
(kvstore/gpu/dtypes.py `BITS_DTYPES`).
"""
from __future__ import annotations

import numpy as np
import torch

from kvstore.gpu.dtypes import BITS_DTYPES, NUMPY_NATIVE


def host_array(t: torch.Tensor) -> np.ndarray | None:
    """`t` as a numpy array sharing its memory (bfloat16 as int16: gpu/dtypes.py `NUMPY_DTYPES`)
    when it is on the CPU, else None. The store's per-page copies slice these: a numpy view is
    several times cheaper to make than a torch view (docs/performance.md)."""
    if t.is_cpu and not t.requires_grad and (t.dtype in NUMPY_NATIVE or t.element_size() in BITS_DTYPES):
        return _as_numpy(t)
    return None


def host_bytes(t: torch.Tensor) -> np.ndarray | None:
    """The bytes of a contiguous CPU tensor as a flat numpy uint8 array sharing its memory; None
    for any other tensor. A page copied from these is a byte copy (no dtype, no shape to match)."""
    if t.is_contiguous():
        array = host_array(t)
        if array is not None:
            return array.ravel().view(np.uint8)  # ravel: a view, the array being contiguous
    return None


def _as_numpy(t: torch.Tensor) -> np.ndarray:
    # numpy copies same-dtype arrays as raw bytes, so a dtype numpy has is not viewed as an
    # integer type first (torch's per-call overhead is a good part of a small page's copy).
    if t.dtype in NUMPY_NATIVE:
        return t.numpy()
    return t.view(BITS_DTYPES[t.element_size()]).numpy()


def copy_into(dst: torch.Tensor, src: torch.Tensor) -> None:
    """dst[...] = src for tensors of the same shape and dtype (any strides)."""
    if dst.is_cpu and src.is_cpu and dst.dtype == src.dtype \
            and dst.element_size() in BITS_DTYPES and not dst.requires_grad:
        np.copyto(_as_numpy(dst), _as_numpy(src), casting="no")
    else:
        dst.copy_(src)
