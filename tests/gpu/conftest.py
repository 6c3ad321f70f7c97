"""GPU-marked tests need CUDA and CuPy; without them they are skipped with the reason printed."""
from __future__ import annotations

import pytest

from kvstore.gpu.runtime import kernels_unavailable_reason


@pytest.fixture(autouse=True)
def _skip_gpu_without_cuda(request: pytest.FixtureRequest) -> None:
    if request.node.get_closest_marker("gpu") is not None:
        reason = kernels_unavailable_reason()
        if reason is not None:
            pytest.skip(f"needs CUDA + CuPy: {reason}")
