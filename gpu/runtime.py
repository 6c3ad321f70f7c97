"""Compiles `gpu/kernels.cu` once per device with `cupy.RawModule` and launches its kernels on
torch's current CUDA stream, so they order with the caller's torch work without a sync.

CuPy is imported lazily: without CuPy or without CUDA this module imports fine and
`kernels_unavailable_reason()` says why the kernels cannot run. It does not validate kernel
arguments; each kernel's wrapper (gpu/paged.py, gpu/quant.py, gpu/rope.py) does that.
"""
from __future__ import annotations

import threading
import warnings
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np
import torch

SOURCE_PATH = Path(__file__).with_name("kernels.cu")
# Compile options: precise division and no flush-to-zero are NVRTC's defaults and the kernels
# rely on them to match the torch references bit for bit; say so explicitly anyway.
NVRTC_OPTIONS = ("-std=c++17", "-prec-div=true", "-ftz=false")

_lock = threading.Lock()
_modules: dict[int, Any] = {}  # device index -> cupy.RawModule (compiled lazily by CuPy)
_cupy: ModuleType | None = None
_cupy_error: str | None = None


class KernelsUnavailable(RuntimeError):
    """The CUDA kernels cannot run here (no CUDA device, or CuPy missing)."""


# The extra that installs the CuPy for each CUDA major version (pyproject.toml).
CUPY_EXTRAS = {12: "gpu-cuda12", 13: "gpu"}


def _import_cupy() -> ModuleType | None:
    """CuPy, built for CUDA 12 (cupy-cuda12x) or 13 (cupy-cuda13x): both are the module `cupy`;
    None, with `_cupy_error` saying why, where it cannot be imported or cannot run here."""
    global _cupy, _cupy_error
    if _cupy is None and _cupy_error is None:
        try:
            import cupy  # noqa: PLC0415 - optional extra, kvstore[gpu] or kvstore[gpu-cuda12]
        except Exception as exc:  # ImportError, or a CUDA library that fails to load
            _cupy_error = (f"CuPy is not importable ({type(exc).__name__}: {exc}); install "
                           f"{' or '.join(f'kvstore[{e}] (CUDA {v})' for v, e in sorted(CUPY_EXTRAS.items()))}")
            return None
        _cupy_error = cupy_unusable_reason(cupy)
        if _cupy_error is None:
            _cupy = cupy
    return _cupy


def cupy_unusable_reason(cupy: ModuleType) -> str | None:
    """Why an imported CuPy cannot run on this machine's driver (its CUDA is newer than the
    driver runs), or None."""
    try:
        built = cupy.cuda.runtime.runtimeGetVersion() // 1000
        driver = cupy.cuda.runtime.driverGetVersion() // 1000
    except Exception as exc:
        return f"CuPy cannot reach the CUDA driver ({type(exc).__name__}: {exc})"
    if built > driver:
        extra = CUPY_EXTRAS.get(driver)
        fix = f"install kvstore[{extra}] instead" if extra else "update the NVIDIA driver"
        return f"CuPy is built for CUDA {built}, but the driver runs CUDA {driver} at most: {fix}"
    return None


def kernels_unavailable_reason() -> str | None:
    """None when the kernels can run; otherwise a sentence saying what is missing."""
    if not torch.cuda.is_available():
        return f"torch {torch.__version__} sees no CUDA device"
    if _import_cupy() is None:
        return _cupy_error
    return None


def kernels_available() -> bool:
    return kernels_unavailable_reason() is None


def require_kernels() -> ModuleType:
    reason = kernels_unavailable_reason()
    if reason is not None:
        raise KernelsUnavailable(f"kvstore CUDA kernels unavailable: {reason}")
    assert _cupy is not None
    return _cupy


def _module(cupy: ModuleType, device_index: int) -> Any:
    with _lock:
        module = _modules.get(device_index)
        if module is None:
            with cupy.cuda.Device(device_index):
                module = cupy.RawModule(code=SOURCE_PATH.read_text(), options=NVRTC_OPTIONS)
                if hasattr(module, "compile"):  # CuPy >= 10: compile now, not in the first launch
                    module.compile()
            _modules[device_index] = module
        return module


# A launch's host time is most of a small page's copy (docs/performance.md, "GPU kernels"), so
# what does not change between launches is looked up once: each kernel per device, and CuPy's
# handle of each torch stream. Reads of these dicts need no lock (a race makes a duplicate entry
# at worst); the handles keep no stream alive, they only name it.
_kernels: dict[tuple[int, str], Any] = {}  # (device index, kernel name) -> compiled kernel
_streams: dict[int, Any] = {}  # raw cudaStream_t -> CuPy stream object naming it
_MAX_STREAMS = 256  # engines use a handful of streams; a long-lived process must not grow without bound


def _kernel(device_index: int, name: str) -> Any:
    kernel = _kernels.get((device_index, name))
    if kernel is None:
        kernel = _module(require_kernels(), device_index).get_function(name)
        _kernels[(device_index, name)] = kernel
    return kernel


# torch's raw current-stream query (what its own extensions call), where this torch build has it.
_raw_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _current_stream_ptr(device_index: int) -> int:
    """The raw handle of torch's current stream on the device, without building a torch.Stream."""
    if _raw_current_stream is not None:
        return _raw_current_stream(device_index)
    return torch.cuda.current_stream(device_index).cuda_stream


def _stream(ptr: int) -> Any:
    stream = _streams.get(ptr)
    if stream is None:
        cupy = require_kernels()
        if len(_streams) >= _MAX_STREAMS:
            _streams.clear()
        # Stream.from_external (CuPy >= 14) wants an object with __cuda_stream__; ExternalStream,
        # deprecated there, takes the raw handle in every CuPy this runs with.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            stream = cupy.cuda.ExternalStream(ptr)
        _streams[ptr] = stream
    return stream


def launch(name: str, device: torch.device, grid: tuple[int, ...], block: tuple[int, ...],
           args: tuple[Any, ...]) -> None:
    """Launch kernel `name` on `device`'s current torch stream. `args` must already be the C types
    the kernel declares (see `ptr`, `i32`, `i64`): CuPy packs Python scalars by their own type."""
    assert device.type == "cuda" and device.index is not None, device
    kernel = _kernel(device.index, name)
    stream = _stream(_current_stream_ptr(device.index))
    if torch.cuda.current_device() == device.index:
        kernel(grid, block, args, stream=stream)
    else:
        with require_kernels().cuda.Device(device.index):
            kernel(grid, block, args, stream=stream)


def ptr(t: torch.Tensor) -> np.uint64:
    """A tensor's device address as the kernel's pointer argument."""
    return np.uint64(t.data_ptr())


def i32(value: int) -> np.int32:
    if not -(1 << 31) <= value < (1 << 31):
        raise ValueError(f"{value} does not fit the kernel's 32-bit int argument")
    return np.int32(value)


def i64(value: int) -> np.int64:
    return np.int64(value)
