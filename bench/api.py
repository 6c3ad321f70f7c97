"""Sidecar store/fetch throughput and latency over shared memory and TCP, 1 and 8 clients, beside
redis-py SET/GET of the same bytes on a local redis-server, alternated in rounds in one run.

    python bench/api.py [--seconds 3] [--rounds 3] [--json out.json]

docs/performance.md, "Sidecar against Redis". `PYTHONPATH=/old/site` measures another kvstore.
"""
from __future__ import annotations

import os
import socket
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

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: an older kvstore there wins

import kvstore  # noqa: E402
from kvstore.api.client import KVStoreClient  # noqa: E402
from kvstore import ModelSpec  # noqa: E402
from bench.engines import RedisServer  # noqa: E402
from bench.ops import redis_configs, start_sidecar  # noqa: E402
from bench.report import markdown_table, parser as bench_parser, write_json  # noqa: E402

# 32 KiB of KV per token (8 layers x 8 KV heads x 128 dims, fp16), 16-token pages of 512 KiB:
# a 2 MiB value is 64 tokens = 4 pages, a 64 KiB value 2 tokens (one tail page).
SPEC = ModelSpec(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16", page_size=16)
SIZES = {"64KiB": 64 << 10, "2MiB": 2 << 20}
TARGETS = {("2MiB", "fetch"): 1.5, ("2MiB", "store"): 1.0}
# Stricter targets for one cell: (size, op, clients, transport) -> ratio.
CELL_TARGETS = {("2MiB", "fetch", 1, "shm"): 2.0}
# p50 latency, 1 client: sidecar fetch / redis-py GET <= this, per transport.
LATENCY_TARGETS = {("64KiB", "fetch"): 2.0}
PRESTORED = 32  # distinct values each fetch/GET cell reads from
REDIS_KEYS = 256  # SETs cycle over this many keys so Redis memory stays bounded
CPU_BYTES = 512 << 20  # the sidecar's CPU tier
CLIENTS = (1, 8)


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
    config: str | None = None  # the redis-py configuration of a `redis` cell (the faster one)


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


# ---- redis (the server: bench/engines.py RedisServer) -------------------------------------------

def redis_cells(port: int, size: str, nbytes: int, clients: int, seconds: float) -> list[Cell]:
    """SET/GET cells for each redis-py configuration (system `redis-<config>`), each client with
    a connection pool of its own (`redis_configs` makes new ones at every call)."""
    value = torch.randn(nbytes // 2).half().numpy().tobytes()
    cells: list[Cell] = []
    for config, admin in redis_configs(port).items():
        for i in range(PRESTORED):
            admin.set(f"get:{size}:{i}", value)
        for c in range(clients):  # the same warm-up as the sidecar's: memory allocated and touched
            for i in range(REDIS_KEYS):
                admin.set(f"set:{size}:{c}:{i}", value)

        def set_op(c: int, config: str = config) -> Callable[[int], None]:
            r = redis_configs(port)[config]
            return lambda i: r.set(f"set:{size}:{c}:{i % REDIS_KEYS}", value)

        def get_op(c: int, config: str = config) -> Callable[[int], None]:
            r = redis_configs(port)[config]

            def op(i: int) -> None:
                assert len(r.get(f"get:{size}:{(i + c) % PRESTORED}")) == nbytes
            return op

        cells += [summarize(f"redis-{config}", op, size, clients, nbytes, run_clients(clients, seconds, nbytes, make))
                  for op, make in (("store", set_op), ("fetch", get_op))]
    return cells


def faster_redis(cells: list[Cell]) -> list[Cell]:
    """Adds one `redis` cell per (op, size, clients): the redis-py configuration with the higher
    MB/s there (merged cells), its name in `config`."""
    best: dict[tuple[str, str, int], Cell] = {}
    for c in cells:
        if c.system.startswith("redis-"):
            key = (c.op, c.size, c.clients)
            if key not in best or c.mb_per_s > best[key].mb_per_s:
                best[key] = c
    return cells + [Cell("redis", c.op, c.size, c.clients, c.ops, c.mb_per_s, c.p50_ms, c.p99_ms,
                         config=c.system[len("redis-"):]) for c in best.values()]


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
    rows = []
    for (system, op, size, clients), c in by.items():
        if not system.startswith("sidecar"):
            continue
        transport = "tcp" if system == "sidecar-tcp" else "shm"
        r = by.get(("redis", op, size, clients))
        target = CELL_TARGETS.get((size, op, clients, transport), TARGETS.get((size, op)))
        ratio = c.mb_per_s / r.mb_per_s if r else None
        verdict = "" if target is None or ratio is None else (f">= {target} {'ok' if ratio >= target else 'MISS'}")
        redis = [f"{r.mb_per_s:,.0f}", f"{r.p50_ms:.2f}", f"{r.p99_ms:.2f}", r.config] if r else ["-"] * 4
        rows.append([size, clients, op, transport, f"{c.mb_per_s:,.0f}", f"{c.p50_ms:.2f}", f"{c.p99_ms:.2f}",
                     *redis, "-" if ratio is None else f"{ratio:.2f}x", verdict])
    return (f"loopback TCP, one stream: {loopback:,.0f} MB/s" + (f"   ({redis_note})" if redis_note else "") + "\n"
            + markdown_table(["value", "clients", "op", "transport", "sidecar MB/s", "p50 ms", "p99 ms",
                              "redis-py MB/s", "p50 ms", "p99 ms", "redis-py config", "ratio", "target"], rows))


def latency_rows(cells: list[Cell]) -> list[dict]:
    """One client's p50 latency of the sidecar against redis-py's, per transport, where a latency
    target is set: the redis-py configuration with the lower p50 for that operation counts."""
    by = {(c.system, c.op, c.size, c.clients): c for c in cells}
    rows = []
    for (size, op), target in LATENCY_TARGETS.items():
        redis = [c for c in cells if c.system.startswith("redis-") and (c.op, c.size, c.clients) == (op, size, 1)]
        best = min(redis, key=lambda c: c.p50_ms) if redis else None
        for system, transport in (("sidecar", "shm"), ("sidecar-tcp", "tcp")):
            c = by.get((system, op, size, 1))
            if c is None:
                continue
            ratio = c.p50_ms / best.p50_ms if best else None
            rows.append({"size": size, "op": op, "transport": transport, "sidecar_p50_ms": c.p50_ms,
                         "redis_p50_ms": best.p50_ms if best else None,
                         "redis_config": best.system[len("redis-"):] if best else None,
                         "ratio": ratio, "target": target, "met": None if ratio is None else ratio <= target})
    return rows


def latency_table(rows: list[dict]) -> str:
    return markdown_table(
        ["value", "op", "transport", "sidecar p50 ms", "redis-py p50 ms", "redis-py config", "ratio", "target"],
        ([r["size"], f"{r['op']} latency, 1 client", r["transport"], f"{r['sidecar_p50_ms']:.3f}",
          "-" if r["redis_p50_ms"] is None else f"{r['redis_p50_ms']:.3f}", r["redis_config"] or "-",
          "-" if r["ratio"] is None else f"{r['ratio']:.2f}x",
          "" if r["met"] is None else f"<= {r['target']} {'ok' if r['met'] else 'MISS'}"] for r in rows))


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--seconds", type=float, default=3.0, help="per cell, split over the rounds")
    parser.add_argument("--rounds", type=int, default=3, help="alternate the systems this many times per cell")
    parser.add_argument("--sizes", default=",".join(SIZES))
    parser.add_argument("--no-redis", action="store_true")
    args = parser.parse_args(argv)
    sizes = args.sizes.split(",")
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-") as tmpdir:
        tmp = Path(tmpdir)
        sidecar = start_sidecar(tmp / "data", CPU_BYTES)
        url, where = sidecar.url, sidecar.preamble[0]
        redis, redis_note = None, "redis column skipped: --no-redis" if args.no_redis else None
        if not args.no_redis:
            try:
                redis = RedisServer(tmp).start()
            except RuntimeError as e:
                redis_note = f"redis column skipped: {e}"
        cells: list[Cell] = []
        seq = [0]  # next unused token id, so every sidecar store writes new pages
        warm = [False]
        try:
            loopback = loopback_mb_per_s()
            per_round = args.seconds / args.rounds
            with tqdm(total=len(sizes) * len(CLIENTS) * args.rounds, desc="bench/api", unit="round") as bar:
                for size in sizes:
                    for n in CLIENTS:
                        for _ in range(args.rounds):
                            for transport in ("shm", "tcp"):
                                cells += sidecar_cells(url, size, SIZES[size], n, per_round, seq, warm, transport)
                            if redis is not None:
                                cells += redis_cells(redis.port, size, SIZES[size], n, per_round)
                            bar.update()
            cells = faster_redis(merge_rounds(cells))
        finally:
            sidecar.stop()
            if redis is not None:
                redis.stop()
    latency = latency_rows(cells)
    print(f"kvstore: {os.path.dirname(kvstore.__file__)} (sidecar: {os.path.dirname(where)})")
    print(table(cells, loopback, redis_note))
    if latency:
        print(latency_table(latency))
    write_json(args.json, {"loopback_mb_per_s": loopback, "redis_note": redis_note,
                           "kvstore": os.path.dirname(kvstore.__file__), "cells": [asdict(c) for c in cells],
                           "latency": latency})
    return 0


if __name__ == "__main__":
    sys.exit(main())
