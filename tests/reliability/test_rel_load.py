"""A short load against a real sidecar: 32 clients mixing lookup/store/fetch of 64 KiB - 2 MiB
pages get no 5xx and no wrong byte; byte-a-second clients are cut off with 408 while the load
goes on; connections past --max-connections get 503."""
from __future__ import annotations

from bench.reliability.load import run_load


def test_short_load_slow_clients_and_connection_limit(tmp_path):
    report = run_load(tmp_path, clients=32, duration_s=5.0, slow_clients=2)
    assert report.requests > 100
    assert report.server_errors == 0 and report.wrong_bytes == 0
    assert report.slow_cut_off == report.slow_clients == 2
    assert report.connections_refused >= 16  # 64 allowed, 80 opened
    assert report.peak_rss_anon_bytes < report.baseline_rss_bytes + (512 << 20) + (256 << 20)
