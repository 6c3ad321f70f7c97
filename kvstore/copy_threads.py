"""Large host copies split between the calling thread and a few copy threads.

One core reads and writes memory at a fraction of what the memory system moves: a prompt's KV
(hundreds of MB for a long one) copied by one thread takes about twice as long as by two. The
store's large copies (a fetch answer assembled from its pages, a store's pages written into a
tier, a client's KV into its shared memory) go through `copy_all`, which splits them into parts
that the calling thread and up to `MAX_COPY_THREADS` helpers take in turn.

numpy, not torch: numpy's copy releases the GIL and runs on the thread that calls it, with no
parallel region to join. A helper that the OS has descheduled holds nobody up (torch's OpenMP
threads would: every thread of a parallel region waits for the last): the parts are taken from a
shared counter, so the calling thread takes the parts no helper got to, and it waits only for a
part that a helper has started. Small copies (under `PARALLEL_COPY_BYTES` in all) are done on the
calling thread, where handing parts out would cost more than it saves.

The helpers are one process-wide pool, made at the first large copy and made anew in a forked
child (vLLM forks its workers; a child inherits no threads).
"""
from __future__ import annotations

import itertools
import os
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

import numpy as np

PART_BYTES = 4 << 20  # a part: large enough that taking it costs nothing next to copying it
PARALLEL_COPY_BYTES = 2 * PART_BYTES  # below this, one thread copies everything
MAX_COPY_THREADS = 3  # memory bandwidth, not cores, bounds a copy: more helpers add nothing

Copy = tuple[np.ndarray, np.ndarray]  # (dst, src) of the same shape and dtype

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


def copy_threads() -> int:
    """Helpers a large copy may use: one fewer than this process's cores, at most MAX_COPY_THREADS."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # no affinity on this platform
        cores = os.cpu_count() or 1
    return max(0, min(MAX_COPY_THREADS, cores - 1))


def copy_all(copies: Sequence[Copy]) -> None:
    """dst[...] = src for every (dst, src) in `copies`, which must not overlap one another. When
    they add up to PARALLEL_COPY_BYTES or more, split into parts of about PART_BYTES (along each
    array's first axis) that the copy threads share. Raises the first part's error, after every
    part taken has finished (no thread still writes when this returns)."""
    helpers = copy_threads() if sum(dst.nbytes for dst, _ in copies) >= PARALLEL_COPY_BYTES else 0
    parts = [part for copy in copies for part in _split(*copy)] if helpers else copies
    helpers = min(helpers, len(parts) - 1)
    if helpers <= 0:
        for dst, src in parts:
            dst[...] = src
        return
    batch = _Batch(parts)
    pool = _helpers()
    for _ in range(helpers):
        pool.submit(batch.work)
    batch.work()
    batch.wait()


def _split(dst: np.ndarray, src: np.ndarray) -> list[Copy]:
    """(dst, src) as parts of about PART_BYTES along the first axis (whole, if it has one row)."""
    if dst.shape != src.shape:
        raise ValueError(f"copy: dst {dst.shape} and src {src.shape} differ in shape")
    rows = dst.shape[0] if dst.ndim else 1
    pieces = min(rows, -(-dst.nbytes // PART_BYTES))
    if pieces <= 1:
        return [(dst, src)]
    bounds = [rows * i // pieces for i in range(pieces + 1)]
    return [(dst[a:b], src[a:b]) for a, b in zip(bounds, bounds[1:])]


class _Batch:
    """Parts taken in turn by whichever thread asks next; `wait` returns when all are copied."""

    def __init__(self, parts: Sequence[Copy]):
        self.parts = parts
        self.taken = itertools.count()  # next() is atomic under the GIL: each part is taken once
        self.left = len(parts)
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.error: BaseException | None = None

    def work(self) -> None:
        while True:
            i = next(self.taken)
            if i >= len(self.parts):
                return
            dst, src = self.parts[i]
            try:
                if self.error is None:  # after a failure the rest are only counted off
                    dst[...] = src
            except BaseException as exc:  # handed to the caller by wait()
                self.error = exc
            finally:
                with self.lock:
                    self.left -= 1
                    if self.left == 0:
                        self.done.set()

    def wait(self) -> None:
        self.done.wait()
        if self.error is not None:
            raise self.error


def _helpers() -> ThreadPoolExecutor:
    global _pool
    if _pool is None:
        with _pool_lock:
            if _pool is None:
                _pool = ThreadPoolExecutor(MAX_COPY_THREADS, thread_name_prefix="kvstore-copy")
    return _pool


def _forget_pool() -> None:
    """In a forked child: the parent's pool has no threads here; the next large copy makes one."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool)
