"""Damaged disk tiers: no fetch returns KV that differs from what was stored; damaged records are
misses, deleted and counted on /metrics; a damaged LMDB environment is moved aside, never a crash."""
from __future__ import annotations

import lmdb

from bench.reliability.corruption import run_flips, run_payloads
from kvstore.tiers.disk import DiskTier


def test_flipped_bytes_of_data_mdb_never_serve_wrong_kv(tmp_path):
    report = run_flips(tmp_path, trials=6, flips=(1, 8, 64, 512))
    assert report.fetches == 6 * 60 and report.wrong_kv == 0
    assert report.served_tokens > 0  # a few flipped bytes do not lose everything


def test_corrupt_payloads_and_headers_are_misses_deleted_and_counted(tmp_path):
    report = run_payloads(tmp_path, records=20)
    assert report.wrong_kv == 0
    assert report.served_tokens < report.stored_tokens
    assert 0 < report.corrupt_counted <= 20 and report.corrupt_left == 0


def test_unopenable_environment_is_moved_aside_and_the_tier_starts_empty(tmp_path):
    path = tmp_path / "pages"
    path.mkdir()
    (path / "data.mdb").write_bytes(b"this is not an LMDB file" * 1000)
    tier = DiskTier(str(path), 8 << 20)
    try:
        assert len(tier) == 0
        assert [p.name.startswith("pages.corrupt-") for p in tmp_path.iterdir()].count(True) == 1
    finally:
        tier.close()
    env = lmdb.open(str(path), max_dbs=2, readonly=True)  # the fresh environment is a valid one
    env.close()
