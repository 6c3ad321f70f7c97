"""Concurrent stores, fetches, lookups and model drops, in-process and through a sidecar (shared
memory and TCP, and one killed and restarted): no wrong KV, no read matches what no store could
have written, with nothing evicted every read sees what was acknowledged before it began, and
the store's counters add up. `python bench/chaos.py --only concurrency` runs it full size."""
from __future__ import annotations

import pytest

from bench.reliability.concurrency import Universe, run_in_process, run_restarts, run_sidecar
from tests.concurrency_history import DROP, FETCH, LOOKUP, NOT_FOUND, STORE, History, OpLog, check_counters, \
    check_history


def _history(*ops: tuple) -> History:
    """ops: (kind, root, branch, n, t0, t1, result), model 0, start 0."""
    log = OpLog()
    for kind, root, branch, n, t0, t1, result in ops:
        log.add(kind, 0, root, branch, n, 0, t0, t1, result, 1 if kind == STORE and result > 0 else 0)
    return History.of([log])


UNIVERSE = Universe(seed=0)


def test_checker_flags_a_read_that_misses_what_was_acknowledged_before_it():
    h = _history((STORE, 0, 0, 40, 0, 10, 40), (FETCH, 0, 0, 40, 20, 30, 32), (LOOKUP, 0, 0, 50, 20, 30, 0))
    v = check_history(h, UNIVERSE, nothing_evicted=True)
    assert (v.reads, v.under_matched, v.over_matched) == (2, 2, 0)
    # the same reads while the store was still running, or with eviction, are not owed anything
    overlapping = _history((STORE, 0, 0, 40, 0, 25, 40), (FETCH, 0, 0, 40, 20, 30, 32))
    assert check_history(overlapping, UNIVERSE, nothing_evicted=True).under_matched == 0
    assert check_history(h, UNIVERSE, nothing_evicted=False).under_matched == 0


def test_checker_owes_a_read_the_tokens_another_branch_shares():
    b2 = next(b for b in range(1, UNIVERSE.branches) if UNIVERSE.common(0, 0, 0, b) > 32)
    shared = UNIVERSE.common(0, 0, 0, b2)
    h = _history((STORE, 0, b2, 80, 0, 10, 80), (FETCH, 0, 0, 80, 20, 30, shared - 1),
                 (FETCH, 0, 0, 80, 20, 30, shared), (FETCH, 1, 0, 80, 20, 30, 1))
    v = check_history(h, UNIVERSE, nothing_evicted=True)
    assert (v.under_matched, v.over_matched) == (1, 0)  # another root shares the BOS token only


def test_checker_excuses_what_a_drop_may_have_removed():
    h = _history((STORE, 0, 0, 40, 0, 10, 40), (DROP, 0, 0, 1, 12, 14, 0), (FETCH, 0, 0, 40, 20, 30, 1),
                 (STORE, 1, 0, 40, 15, 16, 40), (FETCH, 1, 0, 40, 20, 30, 0))
    v = check_history(h, UNIVERSE, nothing_evicted=True)
    # The first store may be gone; the second, after the drop, is owed in full (and its BOS token
    # to the first read).
    assert v.under_matched == 1


def test_checker_flags_a_read_of_tokens_no_store_wrote():
    h = _history((STORE, 0, 0, 20, 0, 10, 20), (FETCH, 0, 0, 40, 20, 30, 24),
                 (STORE, 0, 0, 60, 25, 40, NOT_FOUND), (LOOKUP, 0, 0, 60, 35, 50, 21),
                 (STORE, 0, 0, 60, 55, 60, 60), (FETCH, 0, 0, 60, 50, 70, 60))
    v = check_history(h, UNIVERSE, nothing_evicted=False)
    assert (v.reads, v.over_matched) == (3, 2)  # a store that failed wrote nothing; a running one may have


def test_checker_flags_counters_that_do_not_add_up():
    h = _history((STORE, 0, 0, 20, 0, 10, 20), (FETCH, 0, 0, 40, 20, 30, 20), (LOOKUP, 0, 0, 40, 20, 30, 20))
    stats = {"stores": 1, "stored_pages": 1, "fetches": 1, "requested_tokens": 40, "fetched_tokens": 20,
             "lookups": 1, "lookup_hit_tokens": 20, "pages": 2,
             "tiers": {"cpu": {"pages": 2, "bytes": 10, "capacity_bytes": 100}}}
    assert check_counters(h, stats) == []
    assert len(check_counters(h, {**stats, "fetched_tokens": 19, "lookups": 2})) == 2


@pytest.mark.parametrize("capacity, ops", [("nothing evicted", 12_000), ("constant eviction", 6_000)])
def test_threads_in_process(tmp_path, capacity, ops):
    report = run_in_process(tmp_path / "data", ops=ops, capacity=capacity, threads=8, seed=1)
    assert report.ok, report
    assert report.reads > ops // 3 and report.by_kind["stores"] > ops // 4
    assert (report.evictions > 0) == (capacity == "constant eviction")


def test_clients_through_a_sidecar(tmp_path):
    report = run_sidecar(tmp_path / "data", ops=3_000, capacity="nothing evicted", clients=8, seed=2)
    assert report.ok, report
    assert report.reads > 1_000 and report.by_kind["stores"] > 750 and report.evictions == 0


@pytest.mark.slow
@pytest.mark.parametrize("capacity", ["nothing evicted", "constant eviction"])
def test_clients_through_a_sidecar_full_size(tmp_path, capacity):
    report = run_sidecar(tmp_path / "data", ops=200_000, capacity=capacity, clients=8, seed=4)
    assert report.ok, report
    assert (report.evictions > 0) == (capacity == "constant eviction")


def test_clients_through_a_sidecar_killed_and_restarted(tmp_path):
    report = run_restarts(tmp_path / "data", ops=2_500, kills=1, clients=8, seed=3)
    assert report.kills == 1
    assert report.ok, report
    assert report.acked_before_kill > 100 and report.reads_after_restart > 100
