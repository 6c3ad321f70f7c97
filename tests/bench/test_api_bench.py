"""bench/api.py's comparison: each sidecar cell against the faster redis-py configuration for
that operation (by MB/s), and the 64 KiB latency rows against the lower redis-py p50."""
from __future__ import annotations

from bench.api import Cell, faster_redis, latency_rows, table


def cells() -> list[Cell]:
    return [
        Cell("sidecar", "fetch", "64KiB", 1, 100, 150.0, 0.40, 0.9),
        Cell("sidecar-tcp", "fetch", "64KiB", 1, 100, 120.0, 0.50, 0.9),
        Cell("sidecar", "store", "2MiB", 1, 100, 3000.0, 0.70, 1.2),
        Cell("redis-hiredis", "fetch", "64KiB", 1, 100, 600.0, 0.10, 0.2),
        Cell("redis-python", "fetch", "64KiB", 1, 100, 500.0, 0.13, 0.2),
        Cell("redis-hiredis", "store", "2MiB", 1, 100, 600.0, 3.40, 4.0),
        Cell("redis-python", "store", "2MiB", 1, 100, 2400.0, 0.85, 1.0),
    ]


def test_each_operation_is_held_against_the_faster_redis_py() -> None:
    merged = faster_redis(cells())
    best = {(c.op, c.size): c for c in merged if c.system == "redis"}
    assert best[("fetch", "64KiB")].config == "hiredis" and best[("fetch", "64KiB")].mb_per_s == 600.0
    assert best[("store", "2MiB")].config == "python" and best[("store", "2MiB")].mb_per_s == 2400.0
    printed = table(merged, 1000.0, None)
    # 3000 / 2400 MB/s against the pure-Python SET, not 3000 / 600 against hiredis'.
    assert "| 2MiB | 1 | store | shm | 3,000 |" in printed and "| python | 1.25x | >= 1.0 ok |" in printed


def test_latency_rows_per_transport() -> None:
    rows = {r["transport"]: r for r in latency_rows(faster_redis(cells()))}
    assert rows["shm"]["redis_config"] == "hiredis" and rows["shm"]["redis_p50_ms"] == 0.10
    assert abs(rows["shm"]["ratio"] - 4.0) < 1e-9 and rows["shm"]["met"] is False
    assert abs(rows["tcp"]["ratio"] - 5.0) < 1e-9 and rows["tcp"]["target"] == 2.0
