"""gpu/runtime.py on any machine: which CuPy build can run on which driver, with a message that
names the extra to install."""
from __future__ import annotations

from types import SimpleNamespace

from kvstore.gpu.runtime import CUPY_EXTRAS, cupy_unusable_reason


def _cupy(built: int, driver: int | None) -> SimpleNamespace:
    def driver_version() -> int:
        if driver is None:
            raise RuntimeError("no CUDA driver")
        return driver

    return SimpleNamespace(cuda=SimpleNamespace(runtime=SimpleNamespace(runtimeGetVersion=lambda: built,
                                                                        driverGetVersion=driver_version)))


def test_either_cupy_runs_on_a_driver_as_new_as_its_cuda() -> None:
    assert cupy_unusable_reason(_cupy(13000, 13020)) is None
    assert cupy_unusable_reason(_cupy(12080, 13000)) is None  # a CUDA 13 driver runs CUDA 12 builds
    assert cupy_unusable_reason(_cupy(12080, 12090)) is None


def test_a_cupy_newer_than_the_driver_names_the_extra_to_install() -> None:
    reason = cupy_unusable_reason(_cupy(13000, 12040))
    assert reason is not None and "CUDA 13" in reason and f"kvstore[{CUPY_EXTRAS[12]}]" in reason
    assert "update the NVIDIA driver" in (cupy_unusable_reason(_cupy(12000, 11080)) or "")
    assert "cannot reach the CUDA driver" in (cupy_unusable_reason(_cupy(13000, None)) or "")
