"""Tier throughput: CPU and disk store/fetch of 2 MiB pages as ratios to a torch copy of the same
bytes in the same run, disk store with zstd on and off, and lookup cost per page at 8k-128k tokens.

    python bench/tiers.py [--pages 64] [--repeat 5] [--json out.json]

docs/performance.md, "Tiers".
"""
from __future__ import annotations

import os
import sys
from pathlib import Path
import tempfile
import time

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: an older kvstore there wins

import numpy as np  # noqa: E402
import torch  # noqa: E402
from tqdm import tqdm  # noqa: E402

from bench.report import parser as bench_parser, write_json  # noqa: E402
from bench.timing import best_of, interleaved  # noqa: E402
from kvstore import KVStore, ModelSpec, StoreConfig  # noqa: E402

# 32 layers x 8 KV heads x 128 dims x fp16 x 16 tokens = a 2 MiB page (Llama-3-8B's shape).
SPEC_2MIB = ModelSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="float16", page_size=16)


class CopyBaseline:
    """The plain copies a tier path is compared with, run interleaved with it (so both see the
    same machine load): a copy into a tensor that already exists (what a store into a slot is)
    and a copy into a new tensor (what a fetch that returns one is). Each is timed both as
    torch (`copy_`, `clone`) and as numpy's single-threaded memcpy, and the faster one counts,
    so the baseline is the best plain copy this machine does at that moment."""

    def __init__(self, nbytes: int):
        self.src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8)
        self.dst = torch.empty_like(self.src)
        self.dst.copy_(self.src)  # fault the pages in first
        src_np, dst_np = self.src.numpy(), self.dst.numpy()
        self.copy = [lambda: self.dst.copy_(self.src), lambda: np.copyto(dst_np, src_np)]
        self.clone = [lambda: self.src.clone(), lambda: src_np.copy()]


def bench_cpu(pages: int, repeat: int, base: CopyBaseline) -> dict:
    spec = SPEC_2MIB
    n = pages * spec.page_size
    kv = torch.randn(spec.kv_shape(n)).half()  # (L, 2, T, H, D)
    # Room for two calls' pages: every store evicts the oldest, as a full tier does in steady state.
    config = StoreConfig(data_dir=None, disk_bytes=0, cpu_bytes=2 * pages * spec.page_bytes)
    with KVStore(config) as store:
        store.register_model("m", spec)
        counter = iter(range(1, 10**9))

        def store_once() -> None:
            first = next(counter) * n
            store.store("m", list(range(first, first + n)), kv)

        for _ in range(3):
            store_once()  # fault every slot in, as in a long-running store
        store_s, copy_s, store_ratio = interleaved(store_once, base.copy, repeat).values()
        tokens = list(range(next(counter) * n, 0, -1))[:n]
        store.store("m", tokens, kv)
        fetch_s, clone_s, fetch_ratio = interleaved(lambda: store.fetch("m", tokens), base.clone, repeat).values()
        assert torch.equal(store.fetch("m", tokens).kv, kv)
    return {"store_s": store_s, "copy_s": copy_s, "store_ratio": store_ratio,
            "fetch_s": fetch_s, "clone_s": clone_s, "fetch_ratio": fetch_ratio}


def bench_disk(pages: int, repeat: int, data_dir: str, compression: str, base: CopyBaseline) -> dict:
    spec = SPEC_2MIB
    n = pages * spec.page_size
    kv = torch.randn(spec.kv_shape(n)).half()  # (L, 2, T, H, D)
    nbytes = kv.numel() * 2
    path = tempfile.mkdtemp(dir=data_dir)
    config = StoreConfig(data_dir=path, cpu_bytes=0, disk_bytes=(repeat + 2) * 2 * nbytes,
                         disk_compression=compression, promote_on_hit=False)
    store = KVStore(config)
    store.register_model("m", spec)
    # Store throughput counts until the records are committed (close flushes the writer).
    t0 = time.perf_counter()
    for i in range(repeat):
        store.store("m", list(range(i * n, (i + 1) * n)), kv)
    store.close()
    store_s = (time.perf_counter() - t0) / repeat
    pages_dir = os.path.join(path, "pages")
    file_bytes = sum(os.path.getsize(os.path.join(pages_dir, f)) for f in os.listdir(pages_dir))
    with KVStore(config) as store:
        tokens = list(range(0, n))
        store.fetch("m", tokens)  # pages now in the OS page cache
        fetch_s, clone_s, fetch_ratio = interleaved(lambda: store.fetch("m", tokens), base.clone, repeat).values()
        assert torch.equal(store.fetch("m", tokens).kv, kv)
    return {"store_s": store_s, "fetch_s": fetch_s, "clone_s": clone_s, "fetch_ratio": fetch_ratio,
            "file_bytes": file_bytes}


def bench_lookup(lengths: list[int], repeat: int) -> list[dict]:
    spec = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=8, dtype="float16", page_size=16)
    out = []
    with KVStore(StoreConfig(data_dir=None, disk_bytes=0, cpu_bytes=256 << 20)) as store:
        store.register_model("m", spec)
        for length in lengths:
            tokens = list(range(length))
            store.store("m", tokens, torch.zeros(spec.kv_shape(length), dtype=torch.float16))
            assert store.lookup("m", tokens).matched_tokens == length
            seconds = best_of(lambda: store.lookup("m", tokens), repeat)
            pages = length // spec.page_size
            out.append({"tokens": length, "pages": pages, "lookup_s": seconds, "us_per_page": seconds / pages * 1e6})
    return out


def main() -> None:
    parser = bench_parser(__doc__)
    parser.add_argument("--pages", type=int, default=32, help="2 MiB pages per store/fetch call")
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--data-dir", default=None, help="where the disk tier's files go (default: a temp dir)")
    args = parser.parse_args()
    data_dir = args.data_dir or tempfile.mkdtemp(prefix="kvstore-bench-")
    os.makedirs(data_dir, exist_ok=True)
    nbytes = args.pages * SPEC_2MIB.page_bytes
    base = CopyBaseline(nbytes)
    with tqdm(total=4, desc="bench/tiers", unit="step", file=sys.stderr) as steps:
        cpu = bench_cpu(args.pages, args.repeat, base)
        steps.update()
        disk = {}
        for compression in ("none", "zstd"):
            disk[compression] = bench_disk(args.pages, args.repeat, data_dir, compression, base)
            steps.update()
        lookup = bench_lookup([8192, 32768, 131072], args.repeat)
        steps.update()

    def mbps(seconds: float) -> float:
        return nbytes / seconds / 1e6

    copy_s = cpu["copy_s"]
    rows = [
        ("torch copy_ into existing tensor", mbps(copy_s), 1.0, "baseline (store)", None),
        ("torch clone (copy into new tensor)", mbps(cpu["clone_s"]), 1.0, "baseline (fetch)", None),
        ("cpu tier store", mbps(cpu["store_s"]), cpu["store_ratio"], "copy_", 0.7),
        ("cpu tier fetch", mbps(cpu["fetch_s"]), cpu["fetch_ratio"], "clone", 0.7),
        ("disk tier fetch, OS cache, plain", mbps(disk["none"]["fetch_s"]), disk["none"]["fetch_ratio"], "clone", 0.25),
        ("disk tier fetch, OS cache, zstd", mbps(disk["zstd"]["fetch_s"]), disk["zstd"]["fetch_ratio"], "clone", None),
        ("disk tier store, plain", mbps(disk["none"]["store_s"]), copy_s / disk["none"]["store_s"], "copy_", None),
        ("disk tier store, zstd", mbps(disk["zstd"]["store_s"]), copy_s / disk["zstd"]["store_s"], "copy_", None),
    ]
    print(f"\n{args.pages} x 2 MiB pages per call; medians of {args.repeat} runs interleaved with the baseline")
    print(f"{'path':36} {'MB/s':>8} {'ratio':>6} {'vs':>17} {'target':>7}")
    for name, rate, ratio, versus, target in rows:
        print(f"{name:36} {rate:8.0f} {ratio:6.2f} {versus:>17} {('>= ' + str(target)) if target else '':>7}")
    zstd_size = disk["zstd"]["file_bytes"] / max(1, disk["none"]["file_bytes"])
    print(f"zstd file size / plain file size on float16 KV: {zstd_size:.3f}")
    print(f"\n{'lookup tokens':>14} {'pages':>7} {'us/page':>8} {'total ms':>9}")
    for row in lookup:
        print(f"{row['tokens']:>14} {row['pages']:>7} {row['us_per_page']:8.2f} {row['lookup_s'] * 1e3:9.2f}")
    growth = lookup[-1]["lookup_s"] / lookup[0]["lookup_s"]
    print(f"lookup time 128k/8k = {growth:.1f}x for 16x the pages (linear = 16x)")
    write_json(args.json, {"pages_per_call": args.pages, "cpu": cpu, "disk": disk, "lookup": lookup,
                           "rows": [{"path": r[0], "mb_per_s": r[1], "ratio": r[2], "versus": r[3], "target": r[4]}
                                    for r in rows], "zstd_size_ratio": zstd_size})


if __name__ == "__main__":
    main()
