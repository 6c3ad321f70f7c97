"""The store's GPU paths (gather/scatter, int8/fp8 codecs, demotion, promotion, RoPE re-rotation),
each as a share of a plain copy of the same bytes in the same run (1.0 is copy speed; TARGETS).

    python bench/kernels.py [--json FILE]

GPU only (CUDA + CuPy); bench/gpu_check.sh runs it (docs/performance.md, "GPU kernels").
"""
from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: the staged kvstore there wins

from bench.report import parser as bench_parser, write_json  # noqa: E402
from kvstore import KVStore, ModelSpec, StoreConfig  # noqa: E402
from kvstore.codecs import get_codec
from kvstore.gpu import runtime
from kvstore.gpu.dtypes import NUMPY_DTYPES
from kvstore.gpu.paged import gather_pages, scatter_pages
from kvstore.index import Node
from kvstore.gpu.rope import rope_rerotate
from kvstore.page_moves import promote as promote_page
from kvstore.tiers.gpu import GPUTier

H, D, P = 8, 128, 16
TARGET_S = 0.05  # time each measurement for about this long
PAGE_KIB = (64, 512, 2048)
BATCH_PAGES = (1, 8, 64)  # pages moved per call
# The share of its copy baseline each path must reach (on an H200).
TARGETS = {"gather": ("device copy", 0.8), "scatter": ("device copy", 0.8),
           "quantize_int8": ("device copy", 0.7), "dequantize_int8": ("device copy", 0.7),
           "quantize_fp8": ("device copy", 0.7), "dequantize_fp8": ("device copy", 0.7),
           "demote_none": ("pinned D2H copy", 0.8), "demote_int8": ("pinned D2H copy", 0.8),
           "promote": ("pinned H2D copy", 0.8)}


def device_time_s(fn: Callable[[], Any]) -> float:
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
    iters = max(3, min(200, int(TARGET_S / once)))
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1e3 / iters


def wall_time_s(fn: Callable[[], None], reset: Callable[[], None] | None = None) -> float:
    """Mean host wall seconds per call (the store's per-page Python and synchronisation
    included); `reset`, untimed, undoes a call before the next."""
    samples: list[float] = []
    total = 0.0
    while len(samples) < 4 or total < TARGET_S:
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        samples.append(time.perf_counter() - t0)
        total += samples[-1]
        if reset is not None:
            reset()
    return sum(samples[1:]) / (len(samples) - 1)  # the first call warms up


def device_copy_s(nbytes: int) -> float:
    src = torch.empty(max(1, nbytes), dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return device_time_s(lambda: dst.copy_(src))


class Rows:
    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def add(self, path: str, page_bytes: int, batch: int, path_s: float, baseline_s: float, baseline: str) -> None:
        share = baseline_s / path_s
        self.rows.append({"path": path, "page_bytes": page_bytes, "batch": batch, "seconds": path_s,
                          "baseline": baseline, "baseline_seconds": baseline_s, "share": share})
        print(f"{path:16s} page {page_bytes >> 10:5d} KiB x {batch:3d}: {path_s * 1e6:9.1f} us, "
              f"{baseline} {baseline_s * 1e6:9.1f} us: {share:5.2f}x", flush=True)

    def targets(self) -> list[dict[str, Any]]:
        checks = []
        for path, (baseline, at_least) in TARGETS.items():
            rows = [r for r in self.rows if r["path"] == path]
            if rows:
                worst = min(rows, key=lambda r: r["share"])
                checks.append({"path": path, "baseline": baseline, "at_least": at_least, "worst": worst["share"],
                               "worst_at": {"page_bytes": worst["page_bytes"], "batch": worst["batch"]},
                               "met": worst["share"] >= at_least})
        return checks


def device_rows(spec: ModelSpec, n: int, rows: Rows) -> None:
    """The on-device kernels for a batch of `n` pages, each beside a device copy of its traffic."""
    L, pb, T = spec.num_layers, spec.page_bytes, n * spec.page_size
    nb = max(2 * n, 64)
    cache = torch.randn(nb, L, 2, P, H, D, device="cuda", dtype=torch.float16)  # (num_blocks, L, 2, P, H, D)
    ids = torch.randperm(nb, device="cuda")[:n].contiguous()
    kv = torch.randn(L, 2, T, H, D, device="cuda", dtype=torch.float16)  # (L, 2, T, H, D)
    copy_s = device_copy_s(n * pb)  # reads and writes n pages: the same traffic as gather/scatter
    rows.add("gather", pb, n, device_time_s(lambda: gather_pages(cache, ids, out=kv, check_bounds=False)),
             copy_s, "device copy")
    rows.add("scatter", pb, n, device_time_s(lambda: scatter_pages(kv, cache, ids, check_bounds=False)),
             copy_s, "device copy")
    for fmt in ("int8", "fp8"):
        codec = get_codec(fmt)
        data = torch.empty(codec.encoded_bytes(spec, T), dtype=torch.uint8, device="cuda")
        same = device_copy_s((n * pb + data.numel()) // 2)  # as many bytes read + written
        rows.add(f"quantize_{fmt}", pb, n, device_time_s(lambda: codec.encode(spec, kv, data)), same, "device copy")
        rows.add(f"dequantize_{fmt}", pb, n, device_time_s(lambda: codec.decode(spec, data, T, kv)), same,
                 "device copy")
    k = kv[:, 0]
    delta = torch.full((T,), 4096, device="cuda")
    rows.add("rope_rerotate", pb, n, device_time_s(lambda: rope_rerotate(k, delta, theta=5e5, style="neox", out=k)),
             device_copy_s(k.numel() * k.element_size()), "device copy")


def page_moves(store: KVStore, spec: ModelSpec,
               tokens: list[int]) -> tuple[Callable[[], None], Callable[[], None], Callable[[], None]]:
    """(demote, promote, back_on_gpu_only) for the pages of `tokens`, each held by the GPU tier
    alone: every page evicted from the GPU tier, leaves first as the policies pick them; every page
    promoted back from what a hit's fetch hands over (the page's raw CPU slot, else its rows of the
    fetch answer); and the undoing of `demote`.
    Through the store's own placement and tier stack, under its lock."""
    lock, placement, tiers = store._lock, store._placement, store._tiers
    nodes = sorted((node for node in store._index.nodes.values() if node.parent is not None),
                   key=lambda node: node.depth)
    assert len(nodes) * spec.page_size == len(tokens) and all(set(node.tiers) == {"gpu"} for node in nodes)
    answer = store.fetch("m", tokens).kv  # a hit's answer, host memory, as a fetch makes it
    P = spec.page_size
    views = [answer.numpy().view(NUMPY_DTYPES[spec.dtype])[:, :, i * P:(i + 1) * P] for i in range(len(nodes))]

    def source(node: Node, view: np.ndarray) -> np.ndarray:
        """What a fetch promotes from (FetchPlan._promoted_kv): the raw CPU slot, else the answer."""
        slot = tiers.slot("cpu", node.key)
        raw = tiers.raw_page(spec, "cpu", slot, node.num_tokens) if slot is not None else None
        return view if raw is None else raw

    def demote() -> None:
        with lock:
            for node in reversed(nodes):
                placement.evict(node, "gpu")

    def promote() -> None:
        with lock:
            for node, view in zip(nodes, views):
                promote_page(placement, tiers, spec, node, source(node, view))

    def back_on_gpu_only() -> None:
        promote()
        with lock:
            for node in nodes:
                placement.remove_from(node, "cpu")

    return demote, promote, back_on_gpu_only


def tier_rows(spec: ModelSpec, n: int, rows: Rows) -> None:
    """Demotion and promotion of `n` pages between the GPU and CPU tiers of a real store, through
    its placement and tier stack as an eviction and a hit run them (under the store's lock)."""
    pb = spec.page_bytes
    pinned = torch.empty(n * pb, dtype=torch.uint8).pin_memory()
    device = torch.empty(n * pb, dtype=torch.uint8, device="cuda")
    down_s = wall_time_s(lambda: pinned.copy_(device, non_blocking=True))
    up_s = wall_time_s(lambda: device.copy_(pinned, non_blocking=True))
    tokens = list(range(1, n * P + 1))
    kv = torch.randn(spec.kv_shape(n * P)).half()  # (L, 2, T, H, D)
    for codec in ("none", "int8"):
        store = KVStore(StoreConfig(data_dir=None, gpu_bytes=n * GPUTier.slot_bytes(pb),
                                    cpu_bytes=2 * n * pb + (1 << 20), disk_bytes=0, cpu_codec=codec,
                                    promote_on_hit=False))
        store.register_model("m", spec)
        store.store("m", tokens, kv)
        demote, promote, back_on_gpu_only = page_moves(store, spec, tokens)
        rows.add(f"demote_{codec}", pb, n, wall_time_s(demote, back_on_gpu_only), down_s, "pinned D2H copy")
        assert store.lookup("m", tokens).tiers == {"gpu": len(tokens)}, "a page was left off the GPU tier"
        if codec == "none":  # a hit promotes raw KV whatever the CPU tier's codec: time it once
            demote()
            # Each page is held on the CPU too now: `demote` (eviction) drops only the GPU copy.
            rows.add("promote", pb, n, wall_time_s(promote, demote), up_s, "pinned H2D copy")
            got = store.fetch("m", tokens).kv
            assert torch.equal(got, kv), "promotion changed the KV"
        store.close()


def main() -> None:
    parser = bench_parser(__doc__)
    args = parser.parse_args()
    reason = runtime.kernels_unavailable_reason()
    if reason is not None:
        sys.exit(f"bench/kernels.py needs CUDA and CuPy: {reason}")
    name = torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}", flush=True)
    rows = Rows()
    for kib in PAGE_KIB:
        L = max(1, (kib << 10) // (2 * P * H * D * 2))
        spec = ModelSpec(num_layers=L, num_kv_heads=H, head_dim=D, dtype="float16", page_size=P)
        for n in BATCH_PAGES:
            device_rows(spec, n, rows)
            tier_rows(spec, n, rows)
            torch.cuda.empty_cache()
    checks = rows.targets()
    for check in checks:
        print(f"target {check['path']}: worst {check['worst']:.2f}x {check['baseline']} "
              f"(at least {check['at_least']}x): {'met' if check['met'] else 'MISSED'}")
    write_json(args.json, {"device": name, "torch": torch.__version__, "rows": rows.rows, "targets": checks})


if __name__ == "__main__":
    main()
