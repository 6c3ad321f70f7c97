"""GB/s of every gpu/ kernel next to its torch equivalent and the device's peak memory bandwidth,
plus demotion/promotion (GPU tier <-> pinned host, int8 on the device) next to a plain pinned copy.

    python bench/kernels.py [--json FILE] [--page-kib 64 256 1024 2048] [--batches 1 8 32 128 256]

GPU only (CUDA + CuPy). Pages are float16 KV of H=8 heads, D=128, P=16 tokens; the layer count sets
the page size (64 KiB = 1 layer … 2 MiB = 32 layers). GB/s counts bytes read plus bytes written,
so it compares directly with the memory bandwidth; PCIe rows count the raw KV bytes moved.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from typing import Any, Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from kvstore.gpu import runtime  # noqa: E402
from kvstore.gpu.paged import gather_pages, scatter_pages  # noqa: E402
from kvstore.gpu.quant import dequantize, dequantize_ref, quantize, quantize_ref  # noqa: E402
from kvstore.gpu.rope import rope_rerotate, rope_rerotate_ref  # noqa: E402
from kvstore.codecs import as_kv, get_codec  # noqa: E402
from kvstore.config import ModelSpec  # noqa: E402

H, D, P = 8, 128, 16
TARGET_S = 0.05  # time each measurement for about this long


def time_s(fn: Callable[[], Any], *, min_iters: int = 3) -> float:
    """Mean seconds per call on the GPU, after warm-up, with CUDA events."""
    for _ in range(2):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    once = max(start.elapsed_time(end) / 1e3, 1e-6)
    iters = max(min_iters, min(200, int(TARGET_S / once)))
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def peak_bandwidth_gbs() -> float | None:
    """Theoretical DRAM bandwidth from the device's memory clock and bus width (DDR: x2)."""
    cupy = runtime.require_kernels()
    dev = torch.cuda.current_device()
    try:
        clock_khz = cupy.cuda.runtime.deviceGetAttribute(36, dev)  # cudaDevAttrMemoryClockRate
        bus_bits = cupy.cuda.runtime.deviceGetAttribute(37, dev)  # cudaDevAttrGlobalMemoryBusWidth
    except Exception:
        return None
    return 2 * clock_khz * 1e3 * bus_bits / 8 / 1e9 if clock_khz and bus_bits else None


def copy_bandwidth_gbs() -> float:
    """What a plain device-to-device copy reaches (bytes read + written): the practical ceiling."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    return 2 * a.numel() / time_s(lambda: b.copy_(a)) / 1e9


def run(page_kib: list[int], batches: list[int], peak: float | None, ceiling: float) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []

    def record(kernel: str, page_bytes: int, batch: int, nbytes: int, ours_s: float, base_s: float, base: str) -> None:
        gbs, base_gbs = nbytes / ours_s / 1e9, nbytes / base_s / 1e9
        row = {"kernel": kernel, "page_bytes": page_bytes, "batch": batch, "bytes": nbytes, "seconds": ours_s,
               "gbs": gbs, "baseline": base, "baseline_gbs": base_gbs, "vs_baseline": gbs / base_gbs,
               "pct_peak": None if peak is None else 100 * gbs / peak, "pct_copy": 100 * gbs / ceiling}
        rows.append(row)
        pct = "" if peak is None else f" {row['pct_peak']:5.1f}% of peak"
        print(f"{kernel:14s} page {page_bytes >> 10:5d} KiB x {batch:3d}: {gbs:8.1f} GB/s{pct}, "
              f"{row['vs_baseline']:5.2f}x {base} ({base_gbs:.1f} GB/s)", flush=True)

    int8 = get_codec("int8")
    for kib in page_kib:
        L = max(1, (kib << 10) // (2 * P * H * D * 2))
        spec = ModelSpec(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float16", page_size=P)
        for n in batches:
            _device_rows(spec, n, record)
            if n <= 64:  # PCIe rows: per-page calls, as the store makes them
                _pcie(spec, n, record, int8)
            torch.cuda.empty_cache()  # the batch's tensors died with _device_rows' frame
    return rows


def _device_rows(spec: ModelSpec, n: int, record: Callable[..., None]) -> None:
    """The on-device kernels for a batch of `n` pages, each next to its torch equivalent."""
    L, pb = spec.num_layers, spec.page_bytes
    nb = max(2 * n, 64)
    cache = torch.randn(nb, L, 2, P, H, D, device="cuda", dtype=torch.float16)  # (num_blocks, L, 2, P, H, D)
    ids = torch.randperm(nb, device="cuda")[:n].contiguous()
    kv = torch.empty(L, 2, n * P, H, D, device="cuda", dtype=torch.float16)  # (L, 2, T, H, D)
    blocks = torch.empty(n, L, 2, P, H, D, device="cuda", dtype=torch.float16)
    moved = 2 * n * pb
    record("gather", pb, n, moved, time_s(lambda: gather_pages(cache, ids, out=kv, check_bounds=False)),
           time_s(lambda: torch.index_select(cache, 0, ids, out=blocks)), "index_select")
    record("scatter", pb, n, moved, time_s(lambda: scatter_pages(kv, cache, ids, check_bounds=False)),
           time_s(lambda: cache.index_copy_(0, ids, blocks)), "index_copy_")
    scale_rows = kv.numel() // D
    for fmt in ("int8", "fp8"):
        q = torch.empty(kv.shape, device="cuda", dtype=torch.uint8)
        s = torch.empty(kv.shape[:-1], device="cuda", dtype=torch.bfloat16)
        qbytes = kv.numel() * 3 + scale_rows * 2  # read 2 B, write 1 B per element, plus scales
        record(f"quantize_{fmt}", pb, n, qbytes, time_s(lambda: quantize(kv, fmt, q_out=q, scale_out=s)),
               time_s(lambda: quantize_ref(kv, fmt)), "torch ops")
        qv, sv = quantize(kv, fmt)
        record(f"dequantize_{fmt}", pb, n, qbytes, time_s(lambda: dequantize(qv, sv, fmt, torch.float16, out=kv)),
               time_s(lambda: dequantize_ref(qv, sv, torch.float16)), "torch ops")
    k = kv[:, 0]
    delta = torch.full((n * P,), 4096, device="cuda")
    record("rope_rerotate", pb, n, 2 * k.numel() * 2,
           time_s(lambda: rope_rerotate(k, delta, theta=5e5, style="neox", out=k)),
           time_s(lambda: rope_rerotate_ref(k, delta, theta=5e5, style="neox")), "torch ops")


def _pcie(spec: ModelSpec, n: int, record: Callable[..., None], int8: Any) -> None:
    from kvstore.tiers.gpu import GPUTier

    pb, enc = spec.page_bytes, int8.encoded_bytes(spec, spec.page_size)
    tier = GPUTier(n * GPUTier.slot_bytes(pb))
    keys = [i.to_bytes(4, "little") for i in range(n)]
    for key in keys:
        tier.view(tier.allocate(key, pb), pb).copy_(torch.randn(pb // 2, device="cuda").half().view(torch.uint8))
    host = torch.empty(n, enc, dtype=torch.uint8).pin_memory()
    raw_host = torch.empty(n, pb, dtype=torch.uint8).pin_memory()

    def demote() -> None:
        for i, key in enumerate(keys):
            tier.copy_out(key, spec, spec.page_size, int8, host[i])
        tier.stream.synchronize()

    def promote() -> None:
        for i, key in enumerate(keys):
            int8.decode(spec, host[i], spec.page_size, as_kv(spec, tier.view(tier.get(key), pb), spec.page_size))
        torch.cuda.synchronize()

    def plain_down() -> None:
        for i, key in enumerate(keys):
            raw_host[i].copy_(tier.view(tier.get(key), pb), non_blocking=True)
        torch.cuda.synchronize()

    def plain_up() -> None:
        for i, key in enumerate(keys):
            tier.view(tier.get(key), pb).copy_(raw_host[i], non_blocking=True)
        torch.cuda.synchronize()

    record("demote_int8", pb, n, n * pb, _wall(demote), _wall(plain_down), "pinned .to()")
    record("promote_int8", pb, n, n * pb, _wall(promote), _wall(plain_up), "pinned .to()")
    tier.close()


def _wall(fn: Callable[[], None]) -> float:
    """Host wall time per call: these include the Python per-page calls the store makes."""
    fn()
    iters, t0 = 0, time.perf_counter()
    while iters < 3 or time.perf_counter() - t0 < TARGET_S:
        fn()
        iters += 1
    return (time.perf_counter() - t0) / iters


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", metavar="FILE", help="write every row and the device figures as JSON")
    parser.add_argument("--page-kib", type=int, nargs="+", default=[64, 256, 1024, 2048])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    args = parser.parse_args()
    reason = runtime.kernels_unavailable_reason()
    if reason is not None:
        sys.exit(f"bench/kernels.py needs CUDA and CuPy: {reason}")
    peak, ceiling = peak_bandwidth_gbs(), copy_bandwidth_gbs()
    name = torch.cuda.get_device_name()
    print(f"{name}: peak {peak and round(peak)} GB/s (clock x bus width), torch copy {ceiling:.0f} GB/s", flush=True)
    rows = run(args.page_kib, args.batches, peak, ceiling)
    big = [r for r in rows if r["page_bytes"] >= 2 << 20 and r["batch"] >= 32 and r["kernel"] in ("gather", "scatter")]
    if big and peak:
        worst = min(big, key=lambda r: r["gbs"])
        print(f"targets: gather/scatter 2 MiB x >=32: worst {worst['gbs']:.0f} GB/s = {worst['pct_peak']:.0f}% of peak "
              f"(target 50%), {min(r['vs_baseline'] for r in big):.2f}x torch (target 0.8x)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": name, "peak_gbs": peak, "copy_gbs": ceiling, "torch": torch.__version__,
                       "rows": rows}, f, indent=1,
                      default=lambda v: None if isinstance(v, float) and math.isnan(v) else v)
        print(f"wrote {args.json}")


if __name__ == "__main__":
    main()
