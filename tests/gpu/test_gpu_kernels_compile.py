"""kernels.cu compiles with NVRTC (what cupy.RawModule compiles it with) and defines every kernel
the Python wrappers launch: each copy width, quantize and dequantize for each format, KV dtype
and vector width, and RoPE for each dtype (gpu/paged.py, gpu/quant.py and gpu/rope.py
`kernel_names`, built from what their launches pick from). NVRTC needs no GPU: `make install`
brings its wheel, so this runs on every machine; KVSTORE_NVRTC=/path/to/libnvrtc.so picks
another. Skipped, saying so, only where no libnvrtc is found."""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re

import pytest

from kvstore.gpu import paged, quant, rope
from kvstore.gpu.runtime import NVRTC_OPTIONS, SOURCE_PATH

# Ampere (A100), the oldest the kernels target, and Hopper (H100, H200), what this project's
# device runs use.
ARCHITECTURES = ("compute_80", "compute_90")


def _find_nvrtc() -> str | None:
    if os.environ.get("KVSTORE_NVRTC"):
        return os.environ["KVSTORE_NVRTC"]
    try:
        import nvidia  # noqa: PLC0415 - the NVRTC wheels' namespace package (nvidia/cu13, nvidia/cuda_nvrtc)
    except ImportError:
        return ctypes.util.find_library("nvrtc")
    for root in nvidia.__path__:
        hits = sorted(glob.glob(os.path.join(root, "*", "lib", "libnvrtc.so*")), reverse=True)  # newest first
        hits = [h for h in hits if "builtins" not in h and ".alt." not in h]
        if hits:
            return hits[0]
    return ctypes.util.find_library("nvrtc")


def _compile_ptx(lib: ctypes.CDLL, arch: str) -> str:
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), SOURCE_PATH.read_bytes(), b"kernels.cu", 0, None, None) == 0
    opts = [o.encode() for o in NVRTC_OPTIONS] + [f"--gpu-architecture={arch}".encode()]
    try:
        rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
        size = ctypes.c_size_t()
        lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
        log = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetProgramLog(prog, log)
        assert rc == 0, f"{arch}: {log.value.decode()}"
        assert "warning" not in log.value.decode().lower(), f"{arch}: {log.value.decode()}"
        lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
        ptx = ctypes.create_string_buffer(size.value)
        lib.nvrtcGetPTX(prog, ptx)
        return ptx.value.decode()
    finally:
        lib.nvrtcDestroyProgram(ctypes.byref(prog))


def test_wrappers_name_every_kernel_they_launch() -> None:
    names = paged.kernel_names() | quant.kernel_names() | rope.kernel_names()
    assert len(names) == len(paged.COPY_WIDTHS) + 2 * 2 * 3 * len(quant.VECTOR_WIDTHS) + 3
    assert {"copy_pages_16", "quantize_fp8_bfloat16_v4", "dequantize_int8_float32_v1", "rope_rerotate_float16"} <= names


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_kernels_compile_and_define_every_launched_name(arch: str) -> None:
    path = _find_nvrtc()
    if path is None:
        pytest.skip("libnvrtc not found (make install brings it; or set KVSTORE_NVRTC)")
    entries = set(re.findall(r"\.entry\s+(\w+)", _compile_ptx(ctypes.CDLL(path), arch)))
    launched = paged.kernel_names() | quant.kernel_names() | rope.kernel_names()
    assert launched <= entries, f"launched but not defined: {sorted(launched - entries)}"
