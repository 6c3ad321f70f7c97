"""Full-disk scenario: a sidecar's disk tier on a small tmpfs, filled past what it holds, then by
another file; every store answers 200 or 507, never 500, and whatever is fetched is bit-exact.
Run by `python bench/chaos.py`; the figures: README.md, "Reliability".
"""
from __future__ import annotations

import contextlib
import errno
import os
import subprocess
from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

from kvstore.api.client import KVStoreClient
from bench.reliability.pages import SPEC, expected_kv, served_wrong
from bench.engines import Sidecar, serve_args
from kvstore.errors import InsufficientStorage, KVStoreError

TMPFS_BYTES = 8 << 20


@dataclass
class FullDiskReport:
    durability: str
    filesystem: str = ""
    stores: int = 0
    ok: int = 0
    insufficient_storage: int = 0  # 507
    other_errors: list[str] = field(default_factory=list)  # anything else (must stay empty)
    wrong_kv: int = 0
    alive: bool = False
    newest_from_cpu: bool = False
    disk_pages: int = 0
    disk_evictions: int = 0


@contextlib.contextmanager
def small_filesystem(path: Path) -> Iterator[bool]:
    """Mount a TMPFS_BYTES tmpfs on `path`; yields False (and mounts nothing) where not allowed."""
    path.mkdir(parents=True, exist_ok=True)
    mounted = os.geteuid() == 0 and subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={TMPFS_BYTES}", "tmpfs", str(path)], capture_output=True).returncode == 0
    try:
        yield mounted
    finally:
        if mounted:
            subprocess.run(["umount", "-l", str(path)], capture_output=True)


def run_full_disk(work: Path, *, sequences: int = 800, durability: str = "write-back") -> FullDiskReport:
    report = FullDiskReport(durability)
    mount = work / f"small-fs-{durability}"
    with small_filesystem(mount) as mounted:
        report.filesystem = f"tmpfs {TMPFS_BYTES >> 20} MiB" if mounted else "disk_bytes 1 MiB (no mount)"
        disk_bytes = "256MiB" if mounted else "1MiB"
        sidecar = Sidecar(mount / "data", [*serve_args("1MiB", disk_bytes), "--durability", durability]).start()
        try:
            with KVStoreClient(sidecar.url, timeout_s=60) as client:
                client.register_model("m", SPEC)
                stored = []
                for i in range(sequences):
                    if i == sequences // 4 and mounted:
                        _fill_up(mount / "ballast")  # someone else takes the last byte
                    tokens = list(range(i * 1000, i * 1000 + 64))  # 4 full pages, 16 KiB
                    report.stores += 1
                    try:
                        client.store("m", tokens, expected_kv(SPEC, tokens))
                        report.ok += 1
                        stored.append(tokens)
                    except InsufficientStorage:
                        report.insufficient_storage += 1
                    except KVStoreError as exc:
                        report.other_errors.append(f"{type(exc).__name__}: {exc}")
                # Before the fetches below: they promote older pages into the CPU tier.
                # (a write-through store answered 507 still caches its pages in memory)
                report.newest_from_cpu = client.lookup("m", tokens).tiers.get("cpu", 0) == 64
                for tokens in stored:
                    report.wrong_kv += served_wrong(SPEC, tokens, client.fetch("m", tokens))
                stats = client.stats()
                report.disk_pages = stats["tiers"]["disk"]["pages"]
                report.disk_evictions = stats["tiers"]["disk"]["evictions"]
                report.alive = client.healthz() and sidecar.alive
        finally:
            sidecar.kill()
    return report


def _fill_up(path: Path) -> None:
    """Take every free byte of path's filesystem. The sidecar may have taken them all already:
    then even creating the file fails with ENOSPC, which is the state wanted, not an error."""
    try:
        with open(path, "wb") as f:
            while True:
                f.write(b"\0" * (64 << 10))
                f.flush()
    except OSError as exc:
        if exc.errno != errno.ENOSPC:
            raise
