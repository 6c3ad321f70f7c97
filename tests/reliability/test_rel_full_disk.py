"""The disk tier on a small filesystem: stores answer 200 (eviction) or 507, never 500; the
sidecar stays up and its CPU tier keeps serving; fetched bytes are exact."""
from __future__ import annotations

import pytest

from bench.reliability.full_disk import run_full_disk


@pytest.mark.parametrize("durability", ["write-back", "write-through"])
def test_small_filesystem(tmp_path, durability):
    report = run_full_disk(tmp_path, sequences=600, durability=durability)
    assert report.other_errors == [] and report.ok + report.insufficient_storage == report.stores
    assert report.ok > 0 and report.wrong_kv == 0
    assert report.alive and report.newest_from_cpu
    if durability == "write-back":
        assert report.insufficient_storage == 0  # room is made by eviction; a full disk costs pages only
