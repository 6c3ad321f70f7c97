"""SIGKILL a `kvstore serve` under a store load, restart it: acknowledged write-through pages are
all served bit-exact, nothing else is served for those tokens, LMDB reopens without repair."""
from __future__ import annotations

import pytest

from bench.reliability.crash import run_crash

pytestmark = pytest.mark.heavy  # a sidecar started and killed in every round


def test_write_through_survives_sigkill_at_random_moments(tmp_path):
    report = run_crash(tmp_path / "data", rounds=4, durability="write-through", load_s=0.6, seed=1)
    assert report.acked_stores > 30 and report.checked_sequences >= report.acked_stores
    assert report.lost_acked == 0 and report.wrong_kv == 0 and report.over_served == 0
    assert report.repairs == 0


def test_write_back_serves_only_exact_kv_after_sigkill(tmp_path):
    report = run_crash(tmp_path / "data", rounds=2, durability="write-back", load_s=0.6, seed=2)
    assert report.acked_stores > 20
    assert report.wrong_kv == 0 and report.over_served == 0 and report.repairs == 0


@pytest.mark.slow
def test_write_through_twenty_kills(tmp_path):
    report = run_crash(tmp_path / "data", rounds=20, durability="write-through", seed=3)
    assert report.ok, report
