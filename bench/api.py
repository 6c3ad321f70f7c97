"""Sidecar store/fetch throughput and latency on loopback, beside redis-py SET/GET of the same
bytes against a local redis-server, in one run (docs/design.md §8).

    python bench/api.py [--seconds 3] [--rounds 3] [--json out.json]

Starts `kvstore serve` (CPU tier only, so both sides are in-memory) and `redis-server` (the
Redis column is skipped, with a note, when none is installed) on free loopback ports. For each
value size (64 KiB, 2 MiB) and client count (1, 8 threads, one connection each): store/SET and
fetch/GET throughput (MB/s, 10^6 bytes) and p50/p99 latency, for the client's two transports:
`shm` (its default on loopback: KV through shared memory, api/client_arena.py) and `tcp` (KV
in the HTTP bodies, as for a sidecar on another host). Also measures the raw loopback
TCP throughput of the machine: the ceiling for both.

Each store writes new pages (distinct tokens), as each SET writes a value; fetches read
prestored prefixes, as GETs read prestored keys. Targets (2 MiB): fetch >= 1.5x GET, store >= 1.0x SET.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from tqdm import tqdm

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from kvstore.api.client import KVStoreClient  # noqa: E402
from kvstore import ModelSpec  # noqa: E402

# 32 KiB of KV per token (8 layers x 8 KV heads x 128 dims, fp16), 16-token pages of 512 KiB:
# a 2 MiB value is 64 tokens = 4 pages, a 64 KiB value 2 tokens (one tail page).
SPEC = ModelSpec(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16", page_size=16)
SIZES = {"64KiB": 64 << 10, "2MiB": 2 << 20}
TARGETS = {("2MiB", "fetch"): 1.5, ("2MiB", "store"): 1.0}
PRESTORED = 32  # distinct values each fetch/GET cell reads from
REDIS_KEYS = 256  # SETs cycle over this many keys so Redis memory stays bounded
CPU_BYTES = 512 << 20  # the sidecar's CPU tier


@dataclass
class Cell:
    system: str
    op: str
    size: str
    clients: int
    ops: int
    mb_per_s: float
    p50_ms: float
    p99_ms: float


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_clients(clients: int, seconds: float, nbytes: int,
                make_op: Callable[[int], Callable[[int], None]]) -> tuple[int, float, list[float]]:
    """`clients` threads call their op in a loop for `seconds`; -> (ops, elapsed_s, latencies_s)."""
    latencies: list[list[float]] = [[] for _ in range(clients)]
    ops = [make_op(c) for c in range(clients)]
    barrier = threading.Barrier(clients + 1)
    deadline = [0.0]

    def worker(c: int) -> None:
        op, lat = ops[c], latencies[c]
        op(-1)  # warm-up: connect, first allocations
        barrier.wait()
        i = 0
        while True:
            t0 = time.perf_counter()
            if t0 >= deadline[0]:
                break
            op(i)
            lat.append(time.perf_counter() - t0)
            i += 1

    threads = [threading.Thread(target=worker, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    deadline[0] = time.perf_counter() + 3600
    barrier.wait()
    began = time.perf_counter()
    deadline[0] = began + seconds
    for t in threads:
        t.join()
    elapsed = time.perf_counter() - began
    flat = [x for lat in latencies for x in lat]
    return len(flat), elapsed, flat


def summarize(system: str, op: str, size: str, clients: int, nbytes: int,
              result: tuple[int, float, list[float]]) -> Cell:
    n, elapsed, lat = result
    lat_ms = np.array(lat) * 1e3
    return Cell(system, op, size, clients, n, n * nbytes / elapsed / 1e6,
                float(np.percentile(lat_ms, 50)), float(np.percentile(lat_ms, 99)))


def merge_rounds(cells: list[Cell]) -> list[Cell]:
    """One cell per (system, op, size, clients): the median over rounds of each figure (rounds
    alternate the systems, so a burst of load on this shared machine hits one round, not one system)."""
    groups: dict[tuple[str, str, str, int], list[Cell]] = {}
    for c in cells:
        groups.setdefault((c.system, c.op, c.size, c.clients), []).append(c)
    return [Cell(system, op, size, clients, sum(c.ops for c in group),
                 float(np.median([c.mb_per_s for c in group])), float(np.median([c.p50_ms for c in group])),
                 float(np.median([c.p99_ms for c in group])))
            for (system, op, size, clients), group in groups.items()]


# ---- the sidecar -----------------------------------------------------------------------------

def start_sidecar(tmp: Path) -> tuple[subprocess.Popen, str]:
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "serve", "--port", str(port), "--data-dir",
                             str(tmp / "data"), "--cpu-bytes", str(CPU_BYTES), "--disk-bytes", "0",
                             "--log-level", "warning"],
                            stdout=subprocess.PIPE, text=True, cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
    line = proc.stdout.readline()
    if not line:
        raise SystemExit("kvstore serve did not start")
    return proc, f"http://127.0.0.1:{port}"


def sidecar_cells(url: str, size: str, nbytes: int, clients: int, seconds: float, seq: list[int],
                  warm: list[bool], transport: str) -> list[Cell]:
    """`transport`: "shm" (the client's default on loopback: KV through shared memory) or "tcp"
    (shared memory off: KV in the HTTP bodies)."""
    system = "sidecar" if transport == "shm" else "sidecar-tcp"
    shm_bytes = None if transport == "shm" else 0
    tokens_per_value = nbytes // SPEC.bytes_per_token
    kv = torch.randn(SPEC.kv_shape(tokens_per_value)).half()  # (L, 2, T, H, D)
    model = f"bench-{size}"
    with KVStoreClient(url) as admin:
        admin.register_model(model, SPEC)
        # Fill the CPU tier once before measuring: a long-running sidecar's slab is all touched
        # memory, so first-touch page faults are not what a store costs in steady state.
        while admin.stats()["tiers"]["cpu"]["bytes"] < CPU_BYTES - 2 * nbytes and not warm[0]:
            admin.store(model, np.arange(seq[0], seq[0] + tokens_per_value, dtype=np.int32), kv)
            seq[0] += tokens_per_value
        warm[0] = True
    prestored: list[list[int]] = []

    def prestore() -> None:  # after the store cell, which evicts: fetches must all hit
        with KVStoreClient(url) as admin:
            for i in range(PRESTORED):
                prestored.append(list(range(seq[0], seq[0] + tokens_per_value)))
                seq[0] += tokens_per_value
                admin.store(model, prestored[-1], kv)

    def store_op(c: int) -> Callable[[int], None]:
        client = KVStoreClient(url, shared_memory_bytes=shm_bytes)

        def op(i: int) -> None:
            with lock:  # distinct tokens per store: every call writes new pages
                first = seq[0]
                seq[0] += tokens_per_value
            client.store(model, np.arange(first, first + tokens_per_value, dtype=np.int32), kv)
        return op

    def fetch_op(c: int) -> Callable[[int], None]:
        client = KVStoreClient(url, shared_memory_bytes=shm_bytes)
        toks = [np.array(t, dtype=np.int32) for t in prestored]

        def op(i: int) -> None:
            result = client.fetch(model, toks[(i + c) % PRESTORED])
            assert result.matched_tokens == tokens_per_value
        return op

    lock = threading.Lock()
    stored = summarize(system, "store", size, clients, nbytes, run_clients(clients, seconds, nbytes, store_op))
    prestore()
    return [stored, summarize(system, "fetch", size, clients, nbytes, run_clients(clients, seconds, nbytes, fetch_op))]


# ---- redis -----------------------------------------------------------------------------------

def start_redis(tmp: Path) -> tuple[subprocess.Popen, int] | None:
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    port = free_port()
    proc = subprocess.Popen([exe, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
                             "--dir", str(tmp), "--protected-mode", "no"], stdout=subprocess.DEVNULL)
    import redis

    for _ in range(100):
        try:
            redis.Redis(port=port).ping()
            return proc, port
        except redis.ConnectionError:
            time.sleep(0.05)
    proc.kill()
    return None


def redis_cells(port: int, size: str, nbytes: int, clients: int, seconds: float) -> list[Cell]:
    import redis

    value = torch.randn(nbytes // 2).half().numpy().tobytes()
    admin = redis.Redis(port=port)
    for i in range(PRESTORED):
        admin.set(f"get:{size}:{i}", value)
    for c in range(clients):  # the same warm-up as the sidecar's: memory allocated and touched
        for i in range(REDIS_KEYS):
            admin.set(f"set:{size}:{c}:{i}", value)

    def set_op(c: int) -> Callable[[int], None]:
        r = redis.Redis(port=port)
        return lambda i: r.set(f"set:{size}:{c}:{i % REDIS_KEYS}", value)

    def get_op(c: int) -> Callable[[int], None]:
        r = redis.Redis(port=port)

        def op(i: int) -> None:
            assert len(r.get(f"get:{size}:{(i + c) % PRESTORED}")) == nbytes
        return op

    return [summarize("redis", "store", size, clients, nbytes, run_clients(clients, seconds, nbytes, set_op)),
            summarize("redis", "fetch", size, clients, nbytes, run_clients(clients, seconds, nbytes, get_op))]


# ---- loopback ceiling ------------------------------------------------------------------------

def loopback_mb_per_s(seconds: float = 1.0, block: int = 2 << 20) -> float:
    """One TCP stream over loopback, sender and receiver threads, no Python-side copies."""
    listener = socket.create_server(("127.0.0.1", 0))
    sender = socket.create_connection(listener.getsockname())
    receiver, _ = listener.accept()
    payload = memoryview(bytearray(block))
    received = [0]

    def drain() -> None:
        buf = memoryview(bytearray(block))
        while n := receiver.recv_into(buf):
            received[0] += n

    t = threading.Thread(target=drain)
    t.start()
    began = time.perf_counter()
    while time.perf_counter() - began < seconds:
        sender.sendall(payload)
    sender.close()
    t.join()
    elapsed = time.perf_counter() - began
    receiver.close()
    listener.close()
    return received[0] / elapsed / 1e6


# ---- report ----------------------------------------------------------------------------------

def table(cells: list[Cell], loopback: float, redis_note: str | None) -> str:
    by = {(c.system, c.op, c.size, c.clients): c for c in cells}
    lines = [f"loopback TCP, one stream: {loopback:,.0f} MB/s" + (f"   ({redis_note})" if redis_note else ""),
             "| value | clients | op | transport | sidecar MB/s | p50 ms | p99 ms "
             "| redis-py MB/s | p50 ms | p99 ms | ratio | target |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for (system, op, size, clients), c in by.items():
        if not system.startswith("sidecar"):
            continue
        transport = "tcp" if system == "sidecar-tcp" else "shm"
        r = by.get(("redis", op, size, clients))
        target = TARGETS.get((size, op))
        ratio = c.mb_per_s / r.mb_per_s if r else None
        verdict = "" if target is None or ratio is None else (f">= {target} {'ok' if ratio >= target else 'MISS'}")
        rcols = f"{r.mb_per_s:,.0f} | {r.p50_ms:.2f} | {r.p99_ms:.2f}" if r else "- | - | -"
        lines.append(f"| {size} | {clients} | {op} | {transport} | {c.mb_per_s:,.0f} | {c.p50_ms:.2f} | {c.p99_ms:.2f} "
                     f"| {rcols} | {'-' if ratio is None else f'{ratio:.2f}x'} | {verdict} |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seconds", type=float, default=3.0, help="per cell, split over the rounds")
    parser.add_argument("--rounds", type=int, default=3, help="alternate the systems this many times per cell")
    parser.add_argument("--clients", default="1,8")
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--transports", default="shm,tcp",
                        help="sidecar transports: shm (shared memory, the loopback default) and/or tcp")
    parser.add_argument("--no-redis", action="store_true")
    parser.add_argument("--json", metavar="FILE")
    args = parser.parse_args()
    clients = [int(c) for c in args.clients.split(",")]
    sizes = args.sizes.split(",")
    transports = args.transports.split(",")
    if not set(transports) <= {"shm", "tcp"}:
        parser.error(f"--transports: expected shm and/or tcp, got {args.transports!r}")
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as tmpdir:
        tmp = Path(tmpdir)
        sidecar, url = start_sidecar(tmp)
        redis_proc = None if args.no_redis else start_redis(tmp)
        redis_note = "redis column skipped: --no-redis" if args.no_redis else \
            ("redis column skipped: no redis-server installed" if redis_proc is None else None)
        cells: list[Cell] = []
        seq = [0]  # next unused token id, so every sidecar store writes new pages
        warm = [False]
        try:
            loopback = loopback_mb_per_s()
            per_round = args.seconds / args.rounds
            with tqdm(total=len(sizes) * len(clients) * args.rounds, desc="bench/api", unit="round") as bar:
                for size in sizes:
                    for n in clients:
                        for _ in range(args.rounds):
                            for transport in transports:
                                cells += sidecar_cells(url, size, SIZES[size], n, per_round, seq, warm, transport)
                            if redis_proc is not None:
                                cells += redis_cells(redis_proc[1], size, SIZES[size], n, per_round)
                            bar.update()
            cells = merge_rounds(cells)
        finally:
            sidecar.terminate()
            sidecar.wait(30)
            if redis_proc is not None:
                redis_proc[0].terminate()
                redis_proc[0].wait(10)
    print(table(cells, loopback, redis_note))
    if args.json:
        Path(args.json).write_text(json.dumps({"loopback_mb_per_s": loopback, "redis_note": redis_note,
                                               "cells": [asdict(c) for c in cells]}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
