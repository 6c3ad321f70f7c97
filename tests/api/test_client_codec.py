"""The client's codec sends a KV tensor's bytes as the sidecar reads them: C order, every dtype,
whatever the tensor's strides, without copying a contiguous one."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from kvstore.api.client import codec


@pytest.mark.parametrize("dtype, layout", [
    (dtype, layout) for dtype in (torch.float16, torch.float32, torch.bfloat16)
    for layout in ("contiguous", "strided", "requires_grad", "empty", "numpy")
    if not (dtype is torch.bfloat16 and layout == "numpy")])  # numpy has no bfloat16
def test_kv_bytes_are_the_tensors_c_order_bytes(dtype: torch.dtype, layout: str) -> None:
    kv = torch.randn(2, 2, 6, 3, 4).to(dtype)
    given: object = kv
    if layout == "strided":
        given = kv = kv[:, :, 1:5]  # a window along T: not contiguous
    elif layout == "requires_grad":
        given = kv.clone().requires_grad_()
    elif layout == "empty":
        given = kv = kv[:, :, :0]
    elif layout == "numpy":
        given = kv.numpy()
    raw, name = codec.kv_bytes(given)
    assert name == str(dtype).removeprefix("torch.")
    assert raw.format == "B" and raw.ndim == 1
    assert bytes(raw) == kv.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def test_a_contiguous_kv_is_sent_from_its_own_memory() -> None:
    kv = torch.zeros(1, 2, 4, 2, 8, dtype=torch.float16)
    raw, _ = codec.kv_bytes(kv)
    np.frombuffer(raw, dtype=np.uint8)[:2] = 0xFF  # no copy: the tensor sees it
    assert kv.view(-1)[0].view(torch.int16).item() == -1
