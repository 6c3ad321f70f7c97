"""kernels.cu compiles with NVRTC (what cupy.RawModule uses) and defines every kernel the Python
wrappers launch. NVRTC needs no GPU, so this runs wherever libnvrtc is found
(`pip install nvidia-cuda-nvrtc-cu12`, or KVSTORE_NVRTC=/path/to/libnvrtc.so); skipped otherwise."""
from __future__ import annotations

import ctypes
import ctypes.util
import glob
import os
import re

import pytest

from kvstore.gpu.runtime import NVRTC_OPTIONS, SOURCE_PATH


def _find_nvrtc() -> str | None:
    if os.environ.get("KVSTORE_NVRTC"):
        return os.environ["KVSTORE_NVRTC"]
    try:
        import nvidia.cuda_nvrtc as pkg  # noqa: PLC0415 - optional wheel

        hits = sorted(glob.glob(os.path.join(list(pkg.__path__)[0], "lib", "libnvrtc.so*")))
        hits = [h for h in hits if "builtins" not in h and ".alt." not in h]
        if hits:
            return hits[0]
    except ImportError:
        pass
    return ctypes.util.find_library("nvrtc")


def _compile_ptx(lib_path: str) -> str:
    lib = ctypes.CDLL(lib_path)
    prog = ctypes.c_void_p()
    assert lib.nvrtcCreateProgram(ctypes.byref(prog), SOURCE_PATH.read_bytes(), b"kernels.cu", 0, None, None) == 0
    opts = [o.encode() for o in NVRTC_OPTIONS] + [b"--gpu-architecture=compute_80"]
    rc = lib.nvrtcCompileProgram(prog, len(opts), (ctypes.c_char_p * len(opts))(*opts))
    size = ctypes.c_size_t()
    lib.nvrtcGetProgramLogSize(prog, ctypes.byref(size))
    log = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetProgramLog(prog, log)
    assert rc == 0, log.value.decode()
    lib.nvrtcGetPTXSize(prog, ctypes.byref(size))
    ptx = ctypes.create_string_buffer(size.value)
    lib.nvrtcGetPTX(prog, ptx)
    return ptx.value.decode()


def test_kernels_compile_and_define_every_launched_name() -> None:
    path = _find_nvrtc()
    if path is None:
        pytest.skip("libnvrtc not found (pip install nvidia-cuda-nvrtc-cu12, or set KVSTORE_NVRTC)")
    entries = set(re.findall(r"\.entry\s+(\w+)", _compile_ptx(path)))
    expected = {f"copy_pages_{w}" for w in (16, 8, 4, 2, 1)}
    expected |= {f"{kind}_{fmt}_{dt}_v{v}" for kind in ("quantize", "dequantize") for fmt in ("int8", "fp8")
                 for dt in ("float16", "bfloat16", "float32") for v in (1, 4)}
    expected |= {f"rope_rerotate_{dt}" for dt in ("float16", "bfloat16", "float32")}
    assert expected <= entries, sorted(expected - entries)
