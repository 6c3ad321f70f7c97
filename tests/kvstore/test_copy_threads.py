"""copy_all: large host copies split between threads give exactly numpy's copy, whatever the
threads do (a helper that never runs, a part that fails, a forked child)."""
from __future__ import annotations

import os

import numpy as np
import pytest

from kvstore import copy_threads
from kvstore.copy_threads import PARALLEL_COPY_BYTES, PART_BYTES, copy_all


def _pages(k: int, rows: int, width: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, size=(k, rows, width), dtype=np.uint8)


@pytest.fixture
def two_helpers(monkeypatch):
    monkeypatch.setattr(copy_threads, "copy_threads", lambda: 2)


def test_a_large_strided_copy_lands_exactly_as_numpys(two_helpers):
    # The fetch's shape: k pages of (rows, width) read row by row into an answer's rows.
    src = _pages(40, 60, 12 << 10, seed=1)  # ~29 MiB, many parts
    assert src.nbytes >= PARALLEL_COPY_BYTES
    out = np.zeros((60, 40, 12 << 10), dtype=np.uint8)
    copy_all([(out, src.transpose(1, 0, 2))])
    assert np.array_equal(out, src.transpose(1, 0, 2))


def test_many_small_pairs_and_typed_arrays_are_all_copied(two_helpers):
    # The store's shape: one pair per page, each under a part, typed and as bytes.
    srcs = [np.random.default_rng(i).standard_normal((2, 16, 3, 64 * 40)).astype(np.float32) for i in range(20)]
    dsts = [np.zeros_like(s) for s in srcs]
    flat = np.arange(3 * PART_BYTES, dtype=np.uint8)  # one pair split into parts by bytes
    flat_out = np.zeros_like(flat)
    copy_all([*zip(dsts, srcs), (flat_out, flat)])
    assert all(np.array_equal(d, s) for d, s in zip(dsts, srcs))
    assert np.array_equal(flat_out, flat)


def test_small_copies_stay_on_the_calling_thread(monkeypatch):
    monkeypatch.setattr(copy_threads, "_helpers", lambda: pytest.fail("a small copy asked for helpers"))
    src = np.arange(1 << 20, dtype=np.uint8)
    out = np.zeros_like(src)
    copy_all([(out, src)])
    assert np.array_equal(out, src)
    copy_all([])  # nothing to copy is no error


def test_helpers_that_never_run_do_not_hold_the_copy_up(two_helpers, monkeypatch):
    # A pool whose threads are all busy (or descheduled): the caller takes every part itself.
    queued = []

    class Stalled:
        def submit(self, fn):
            queued.append(fn)

    monkeypatch.setattr(copy_threads, "_helpers", lambda: Stalled())
    src = _pages(8, 4, 1 << 20, seed=2)
    out = np.zeros_like(src)
    copy_all([(out, src)])
    assert np.array_equal(out, src)
    assert len(queued) == 2
    for late in queued:  # a helper that starts after the copy finds nothing left and returns
        late()
    assert np.array_equal(out, src)


def test_a_failing_part_raises_after_every_started_part_is_done(two_helpers, monkeypatch):
    class Refusing(np.ndarray):
        def __setitem__(self, key, value):
            raise OSError("the destination refused a part")

    good_src = _pages(4, 4, 1 << 20, seed=3)
    good_out = np.zeros_like(good_src)
    bad_out = np.zeros((4, 4, 1 << 20), dtype=np.uint8).view(Refusing)
    with pytest.raises(OSError, match="refused a part"):
        copy_all([(good_out, good_src), (bad_out, good_src)])
    again = np.zeros_like(good_src)  # the pool is still usable after a failed batch
    copy_all([(again, good_src)])
    assert np.array_equal(again, good_src)


def test_pairs_of_different_shapes_are_refused_by_name():
    with pytest.raises(ValueError, match=r"dst \(4, 2\) and src \(2, 4\)"):
        copy_threads._split(np.zeros((4, 2)), np.zeros((2, 4)))


def test_a_single_core_copies_alone(monkeypatch):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    assert copy_threads.copy_threads() == 0
    monkeypatch.setattr(copy_threads, "_helpers", lambda: pytest.fail("one core asked for helpers"))
    src = _pages(4, 4, 1 << 20, seed=4)
    out = np.zeros_like(src)
    copy_all([(out, src)])
    assert np.array_equal(out, src)


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_a_forked_child_copies_with_threads_of_its_own(two_helpers):
    src = _pages(8, 4, 1 << 20, seed=5)
    copy_all([(np.zeros_like(src), src)])  # the parent's pool exists before the fork
    pid = os.fork()
    if pid == 0:  # the child: its own pool, the same answer
        try:
            out = np.zeros_like(src)
            copy_all([(out, src)])
            os._exit(0 if np.array_equal(out, src) else 1)
        except BaseException:
            os._exit(2)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
