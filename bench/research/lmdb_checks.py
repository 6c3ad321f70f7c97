"""What proving that LMDB reads stay inside data.mdb costs: at start (the tier's way,
tiers/disk_open.py: the structural verifier and walk in a child) for several file shapes, and at
every read (the alternative: each value's address checked against the map) beside plain `txn.get`.

    python bench/research/lmdb_checks.py [--gib 1]

Figures: docs/reliability.md, "The disk tier's start check, and the per-read alternative".
"""
from __future__ import annotations

import ctypes
import os
import struct
import sys
import tempfile
import time
import timeit
from pathlib import Path

import lmdb
import numpy as np

sys.path.append(str(Path(__file__).resolve().parents[2]))  # after PYTHONPATH: an older kvstore there wins

from bench.report import parser as bench_parser  # noqa: E402
from kvstore.tiers.disk_open import check_in_child, verify_structure, walk  # noqa: E402

PAGE_BYTES = 4096


def build(path: str, records: int, value_bytes: int) -> None:
    env = lmdb.open(path, map_size=max(64 << 20, records * (value_bytes + 2 * PAGE_BYTES) * 2), max_dbs=2)
    meta, data = env.open_db(b"meta"), env.open_db(b"data")
    payload = os.urandom(value_bytes)
    for first in range(0, records, 200):
        with env.begin(write=True) as txn:
            for _ in range(first, min(records, first + 200)):
                key = os.urandom(16)
                txn.put(key, os.urandom(150), db=meta)
                txn.put(key, payload, db=data)
    with env.begin(write=True) as txn:
        for i, (key, _) in enumerate(list(txn.cursor(db=meta))):
            if i % 7 == 0:
                txn.delete(key, db=meta)
                txn.delete(key, db=data)
    env.close()


def start_costs(work: Path, gib: float) -> list[str]:
    rows = []
    total = int(gib * (1 << 30))
    for value_bytes in (4 << 10, 64 << 10, 2 << 20):
        records = max(100, total // value_bytes // (8 if value_bytes == 4 << 10 else 1))
        path = str(work / f"env-{value_bytes}")
        build(path, records, value_bytes)
        size = os.path.getsize(os.path.join(path, "data.mdb"))
        began = time.perf_counter()
        assert verify_structure(path) is None
        verify_s = time.perf_counter() - began
        began = time.perf_counter()
        assert walk(path) is None  # verifies, then walks through LMDB
        walk_s = time.perf_counter() - began
        began = time.perf_counter()
        assert check_in_child(path) is None
        child_s = time.perf_counter() - began
        rows.append(f"| {records:,} records of {value_bytes >> 10} KiB ({size / (1 << 20):,.0f} MiB) "
                    f"| {verify_s:.2f} | {walk_s:.2f} | {child_s:.2f} |")
    return rows


def _map_range(path: str) -> tuple[int, int]:
    inode = os.stat(os.path.join(path, "data.mdb")).st_ino
    with open("/proc/self/maps") as maps:
        for line in maps:
            parts = line.split()
            if len(parts) >= 6 and int(parts[4]) == inode:
                low, high = (int(x, 16) for x in parts[0].split("-"))
                return low, high
    raise RuntimeError("data.mdb is not mapped")


def read_costs(work: Path) -> list[str]:
    path = str(work / "reads")
    os.makedirs(path)
    env = lmdb.open(path, map_size=256 << 20, max_dbs=2)
    data = env.open_db(b"data")
    sizes = {"4 KiB": 4 << 10, "64 KiB": 64 << 10, "2 MiB": 2 << 20}
    with env.begin(write=True) as txn:
        for name, n in sizes.items():
            txn.put(name.encode(), os.urandom(n), db=data)
    base, end = _map_range(path)
    end = min(end, base + os.path.getsize(os.path.join(path, "data.mdb")))

    def checked(view: memoryview) -> bytes:
        size = len(view)
        addr = np.frombuffer(view, np.uint8).ctypes.data
        if not (base <= addr and addr + size <= end):
            raise ValueError("value outside the mapped file")
        if (addr - base) % PAGE_BYTES == 16:  # an overflow value: its page's header must agree
            pgno, _, flags, pages = struct.unpack("<QHHI", ctypes.string_at(addr - 16, 16))
            if not flags & 0x04 or pgno != (addr - 16 - base) // PAGE_BYTES or size > pages * PAGE_BYTES - 16:
                raise ValueError("overflow header disagrees")
        return bytes(view)

    rows = []
    for name, n in sizes.items():
        key = name.encode()

        def plain() -> bytes:
            with env.begin() as txn:
                return txn.get(key, db=data)

        def check() -> bytes:
            with env.begin(buffers=True) as txn:
                return checked(txn.get(key, db=data))

        assert plain() == check()
        number = 200 if n >= 1 << 20 else 2000
        a = min(timeit.repeat(plain, number=number, repeat=7)) / number * 1e6
        b = min(timeit.repeat(check, number=number, repeat=7)) / number * 1e6
        rows.append(f"| {name} | {a:.1f} | {b:.1f} | {b - a:+.1f} ({(b - a) / a:+.0%}) |")
    env.close()
    return rows


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__, with_json=False)
    parser.add_argument("--gib", type=float, default=1.0, help="size of the 64 KiB and 2 MiB environments")
    args = parser.parse_args(argv)
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        print("| environment | lmdb.verify (s) | verify + LMDB walk, in process (s) "
              "| the start check, in a child (s) |\n|---|---|---|---|")
        print("\n".join(start_costs(work, args.gib)))
        print("\n| value | txn.get (us) | txn.get(buffers=True) + extent check + copy (us) "
              "| extra per read (us) |\n|---|---|---|---|")
        print("\n".join(read_costs(work)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
