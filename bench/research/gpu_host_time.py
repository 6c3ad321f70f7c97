"""Where a GPU path's host time goes: each step of a kernel launch through CuPy timed alone, and
the store's demotion and promotion of a batch of pages profiled by function.

    python bench/research/gpu_host_time.py [--pages 64] [--page-kib 64]

GPU only (CUDA + CuPy). On small pages the store's GPU paths are bound by host time, not by the
GPU's bandwidth: bench/kernels.py shows how much, and this shows where it goes.
"""
from __future__ import annotations

import argparse
import cProfile
import io
import pstats
import sys
import time
import traceback
import warnings
from pathlib import Path
from typing import Any, Callable

import torch

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after PYTHONPATH: a staged kvstore wins

from bench.kernels import page_moves  # noqa: E402
from kvstore import KVStore, ModelSpec, StoreConfig  # noqa: E402
from kvstore.codecs import get_codec  # noqa: E402
from kvstore.gpu import runtime  # noqa: E402
from kvstore.gpu.paged import gather_pages  # noqa: E402
from kvstore.tiers.gpu import GPUTier  # noqa: E402

H, D, P = 8, 128, 16


def host_us(fn: Callable[[], Any], calls: int = 2000) -> float:
    """Mean host microseconds per call, the GPU drained before and after."""
    fn()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    elapsed = time.perf_counter() - t0
    torch.cuda.synchronize()
    return elapsed / calls * 1e6


def step(label: str, fn: Callable[[], Any], calls: int = 2000) -> None:
    try:
        print(f"{label:58s} {host_us(fn, calls):8.2f} us", flush=True)
    except Exception:
        print(f"{label:58s} FAILED", flush=True)
        traceback.print_exc()


def profile(label: str, fn: Callable[[], Any], rows: int = 25,
            reset: Callable[[], Any] | None = None) -> None:
    """cProfile of one call after a warm-up; `reset`, unprofiled, undoes a call."""
    try:
        fn()
        if reset is not None:
            reset()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        fn()
        torch.cuda.synchronize()
        prof.disable()
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(rows)
        print(f"--- {label}\n{text.getvalue()}", flush=True)
    except Exception:
        print(f"--- {label}: FAILED", flush=True)
        traceback.print_exc()


def launch_steps(spec: ModelSpec, n: int) -> None:
    cupy = runtime.require_kernels()
    device = torch.device("cuda", torch.cuda.current_device())
    L, T = spec.num_layers, n * P
    cache = torch.randn(max(2 * n, 64), L, 2, P, H, D, device=device, dtype=torch.float16)
    ids = torch.randperm(cache.shape[0], device=device)[:n].contiguous()
    kv = torch.empty(L, 2, T, H, D, device=device, dtype=torch.float16)
    src = torch.empty(n * spec.page_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    module = runtime._module(cupy, device.index)
    name = "copy_pages_16"
    kernel = module.get_function(name)
    stream = torch.cuda.current_stream(device)
    args = (runtime.ptr(kv), runtime.i64(1), runtime.ptr(ids), runtime.i64(0), runtime.ptr(kv),
            runtime.i32(0), runtime.i32(P), runtime.i32(1), runtime.i32(0))  # T = 0, num_blocks = 0: no work

    step("torch dst.copy_(src), the baseline", lambda: dst.copy_(src))
    step("gather_pages(check_bounds=False), whole", lambda: gather_pages(cache, ids, out=kv, check_bounds=False))
    step("runtime.require_kernels()", runtime.require_kernels)
    step("torch.cuda.is_available()", torch.cuda.is_available)
    step("runtime._module()", lambda: runtime._module(cupy, device.index))
    step("module.get_function(name)", lambda: module.get_function(name))
    step("torch.cuda.current_stream(device)", lambda: torch.cuda.current_stream(device))
    step("torch.cuda.current_stream().cuda_stream", lambda: torch.cuda.current_stream().cuda_stream)

    def device_ctx() -> None:
        with cupy.cuda.Device(device.index):
            pass
    step("with cupy.cuda.Device(i)", device_ctx)

    def external() -> None:
        cupy.cuda.ExternalStream(stream.cuda_stream)
    step("cupy.cuda.ExternalStream(ptr)", external)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        step("cupy.cuda.ExternalStream(ptr), warnings ignored", external)
    ext = cupy.cuda.ExternalStream(stream.cuda_stream)

    def enter_stream() -> None:
        with ext:
            pass
    step("with <ExternalStream made once>", enter_stream)
    if hasattr(cupy.cuda.Stream, "from_external"):
        step("cupy.cuda.Stream.from_external(torch stream)", lambda: cupy.cuda.Stream.from_external(stream))
    step("runtime.ptr/i32/i64 x 9", lambda: (runtime.ptr(kv), runtime.i64(1), runtime.ptr(ids), runtime.i64(0),
                                             runtime.ptr(kv), runtime.i32(0), runtime.i32(P), runtime.i32(1),
                                             runtime.i32(0)))

    def call_in_stream() -> None:
        with ext:
            kernel((1, 1, 1), (32, 1, 1), args)
    step("kernel(grid, block, args) inside a made stream", call_in_stream)
    step("kernel(..., stream=ext)", lambda: kernel((1, 1, 1), (32, 1, 1), args, stream=ext))
    step("kernel(...) on CuPy's current stream", lambda: kernel((1, 1, 1), (32, 1, 1), args))
    step("runtime.launch(name, ...)", lambda: runtime.launch(name, device, (1, 1, 1), (32, 1, 1), args))
    print(f"kernel type: {type(kernel).__module__}.{type(kernel).__qualname__}; cupy {cupy.__version__}")
    codec = get_codec("int8")
    data = torch.empty(codec.encoded_bytes(spec, T), dtype=torch.uint8, device=device)
    step("int8 codec.encode, whole", lambda: codec.encode(spec, kv, data))
    profile("int8 codec.encode x 200", lambda: [codec.encode(spec, kv, data) for _ in range(200)])
    profile("gather_pages x 200", lambda: [gather_pages(cache, ids, out=kv, check_bounds=False)
                                             for _ in range(200)])


def tier_profile(spec: ModelSpec, n: int) -> None:
    pb = spec.page_bytes
    tokens = list(range(1, n * P + 1))
    kv = torch.randn(spec.kv_shape(n * P)).half()  # (L, 2, T, H, D)
    store = KVStore(StoreConfig(data_dir=None, gpu_bytes=n * GPUTier.slot_bytes(pb),
                                cpu_bytes=2 * n * pb + (1 << 20), disk_bytes=0, promote_on_hit=False))
    store.register_model("m", spec)
    store.store("m", tokens, kv)
    demote, promote, back_on_gpu_only = page_moves(store, spec, tokens)
    profile(f"demote {n} pages of {pb >> 10} KiB", demote, 30, reset=back_on_gpu_only)
    profile(f"promote {n} pages of {pb >> 10} KiB", promote, 30, reset=demote)
    store.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pages", type=int, default=64)
    parser.add_argument("--page-kib", type=int, default=64)
    args = parser.parse_args()
    reason = runtime.kernels_unavailable_reason()
    if reason is not None:
        sys.exit(f"bench/research/gpu_host_time.py needs CUDA and CuPy: {reason}")
    L = max(1, (args.page_kib << 10) // (2 * P * H * D * 2))
    spec = ModelSpec(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float16", page_size=P)
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}; {args.pages} pages of {spec.page_bytes} bytes")
    launch_steps(spec, args.pages)
    tier_profile(spec, args.pages)


if __name__ == "__main__":
    main()
