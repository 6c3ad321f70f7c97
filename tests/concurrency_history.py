"""A history of concurrent store operations and the check of it (a linearizability-style check
for a cache whose KV is a known function of its tokens).

Every operation is logged by the thread that ran it: its kind, model, sequence, start and end
time (one monotonic clock for every thread) and its result. A sequence is `(root, branch, n)`
of a `Universe` (bench/reliability/concurrency.py, which runs the operations): the first n tokens of one branch of one
root. Sequences share tokens as the universe says (`Universe.common`), so how many leading
tokens two sequences share is known without comparing tokens.

The check (`check_history`) counts, for the reads (fetches and lookups) that succeeded:

- over-matched: a read matched more tokens than any store could have written that started
  before the read ended (a store's bound is what it acknowledged, or all its tokens if it
  failed or its answer never came: it may have written them);
- under-matched (only when nothing is evicted): a read matched fewer tokens than a store
  acknowledged that ended before the read started, unless a drop of the model may have come
  between them (a drop that ended after the store began and began before the read ended).

Wrong KV is checked where the bytes are, by the thread that read them (`kv_ok`), and the store's
own request counters are compared with the history's sums (`check_counters`).
"""
from __future__ import annotations

from array import array
from bisect import bisect_left
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

STORE, FETCH, LOOKUP, DROP = 0, 1, 2, 3
KIND_NAMES = ("store", "fetch", "lookup", "drop")
# Results below 0: the operation failed. NOT_FOUND: the model was not registered (it did
# nothing); FULL: InsufficientStorage (counted as a store, may have written pages); LOST: no
# answer came (the sidecar was down or died: it may have done all of it); ERROR: anything else.
NOT_FOUND, FULL, LOST, ERROR = -1, -2, -3, -4


class Shares(Protocol):
    """How many leading tokens two sequences of a universe share, and its models' number."""

    models: tuple[str, ...]

    def common(self, root: int, branch: int, other_root: int, other_branch: int) -> int: ...


class OpLog:
    """One thread's operations, in columns (a million operations stay a few tens of MB)."""

    __slots__ = ("kind", "model", "root", "branch", "n", "start", "t0", "t1", "result", "pages", "kv_ok")

    def __init__(self) -> None:
        for name in ("kind", "model", "kv_ok"):
            setattr(self, name, array("b"))
        for name in ("root", "branch", "n", "start", "result", "pages"):
            setattr(self, name, array("i"))
        self.t0, self.t1 = array("q"), array("q")

    def add(self, kind: int, model: int, root: int, branch: int, n: int, start: int, t0: int, t1: int,
            result: int, pages: int = 0, kv_ok: bool = True) -> None:
        self.kind.append(kind)
        self.model.append(model)
        self.root.append(root)
        self.branch.append(branch)
        self.n.append(n)
        self.start.append(start)
        self.t0.append(t0)
        self.t1.append(t1)
        self.result.append(result)
        self.pages.append(pages)
        self.kv_ok.append(kv_ok)

    def __len__(self) -> int:
        return len(self.kind)


@dataclass
class History:
    """Every thread's log, as one set of numpy columns."""

    kind: np.ndarray
    model: np.ndarray
    root: np.ndarray
    branch: np.ndarray
    n: np.ndarray
    start: np.ndarray
    t0: np.ndarray
    t1: np.ndarray
    result: np.ndarray
    pages: np.ndarray
    kv_ok: np.ndarray

    @classmethod
    def of(cls, logs: list[OpLog]) -> "History":
        return cls(**{name: np.concatenate([np.frombuffer(getattr(log, name), dtype=getattr(log, name).typecode)
                                            for log in logs]) if logs else np.zeros(0, np.int64)
                      for name in OpLog.__slots__})

    def __len__(self) -> int:
        return len(self.kind)

    def count(self, kind: int, ok: bool = True) -> int:
        return int(np.count_nonzero((self.kind == kind) & ((self.result >= 0) if ok else True)))


@dataclass
class Verdict:
    reads: int = 0  # fetches and lookups that succeeded, each checked
    over_matched: int = 0
    under_matched: int = 0
    wrong_kv: int = 0
    examples: list[str] = field(default_factory=list)


class Staircase:
    """Completed stores of one sequence family as (start time, tokens): the most tokens
    acknowledged by a store that began at or after a time, in O(log n). Kept entries have
    later start times and fewer tokens, in that order (an entry another beats on both is gone)."""

    __slots__ = ("t0s", "ks")

    def __init__(self) -> None:
        self.t0s: list[int] = []
        self.ks: list[int] = []

    def add(self, t0: int, k: int) -> None:
        t0s, ks = self.t0s, self.ks
        i = bisect_left(t0s, t0)
        if i < len(ks) and ks[i] >= k:
            return  # a store that began no earlier acknowledged as much
        j = i
        while j > 0 and ks[j - 1] <= k:
            j -= 1
        t0s[j:i] = [t0]
        ks[j:i] = [k]

    def since(self, t: float) -> int:
        i = bisect_left(self.t0s, t)
        return self.ks[i] if i < len(self.ks) else 0


def check_history(h: History, universe: Shares, *, nothing_evicted: bool, max_examples: int = 10) -> Verdict:
    v = Verdict()
    reads = np.flatnonzero(((h.kind == FETCH) | (h.kind == LOOKUP)) & (h.result >= 0))
    v.reads = len(reads)
    v.wrong_kv = int(np.count_nonzero((h.kind == FETCH) & (h.result >= 0) & (h.kv_ok == 0)))
    for i in np.flatnonzero((h.kind == FETCH) & (h.result >= 0) & (h.kv_ok == 0))[:max_examples]:
        v.examples.append(f"wrong KV: {_op(h, i)}")
    stores = np.flatnonzero(h.kind == STORE)
    roots, branches = int(h.root.max(initial=0)) + 1, int(h.branch.max(initial=0)) + 1
    # common[r, b, b2]: tokens (r, b) and (r, b2) share; any two roots share their first token.
    common = np.array([[[universe.common(r, b, r, b2) for b2 in range(branches)] for b in range(branches)]
                       for r in range(roots)], dtype=np.int64)
    cross_root = universe.common(0, 0, 1, 0) if roots > 1 else 0

    # Over-matching: reads by end time, stores become possible writers as they begin.
    bound = np.where(h.result[stores] >= 0, h.result[stores], np.where(h.result[stores] == NOT_FOUND, 0, h.n[stores]))
    order = stores[np.argsort(h.t0[stores], kind="stable")]
    bound_of = dict(zip(stores.tolist(), bound.tolist()))
    best = np.zeros((len(universe.models), roots, branches), dtype=np.int64)
    any_root = np.zeros(len(universe.models), dtype=np.int64)
    s = 0
    for i in reads[np.argsort(h.t1[reads], kind="stable")].tolist():
        t1 = h.t1[i]
        while s < len(order) and h.t0[order[s]] < t1:
            j = int(order[s])
            m, r, b, k = int(h.model[j]), int(h.root[j]), int(h.branch[j]), bound_of[j]
            if k > best[m, r, b]:
                best[m, r, b] = k
            if k > any_root[m]:
                any_root[m] = k
            s += 1
        m, r, b, n = int(h.model[i]), int(h.root[i]), int(h.branch[i]), int(h.n[i])
        allowed = min(n, max(int(np.minimum(best[m, r], common[r, b]).max()), min(cross_root, int(any_root[m]))))
        if h.result[i] > allowed:
            v.over_matched += 1
            if len(v.examples) < max_examples:
                v.examples.append(f"over-matched ({allowed} possible): {_op(h, i)}")
    if not nothing_evicted:
        return v

    # Under-matching: reads by start time, stores count once they have ended.
    done = stores[h.result[stores] >= 0]
    done = done[np.argsort(h.t1[done], kind="stable")]
    drops = _drop_windows(h, len(universe.models))
    stairs: dict[tuple[int, int, int], Staircase] = {}
    model_stairs = [Staircase() for _ in universe.models]
    s = 0
    for i in reads[np.argsort(h.t0[reads], kind="stable")].tolist():
        t0 = h.t0[i]
        while s < len(done) and h.t1[done[s]] < t0:
            j = int(done[s])
            key = (int(h.model[j]), int(h.root[j]), int(h.branch[j]))
            stair = stairs.get(key)
            if stair is None:
                stair = stairs[key] = Staircase()
            k = int(h.result[j])
            stair.add(int(h.t0[j]), k)
            model_stairs[key[0]].add(int(h.t0[j]), min(k, cross_root))
            s += 1
        m, r, b, n = int(h.model[i]), int(h.root[i]), int(h.branch[i]), int(h.n[i])
        excused_before = drops[m].excused_before(int(h.t1[i]))
        required = min(n, model_stairs[m].since(excused_before))
        for b2 in range(branches):
            stair = stairs.get((m, r, b2))
            if stair is not None:
                required = max(required, min(n, int(common[r, b, b2]), stair.since(excused_before)))
        if h.result[i] < required:
            v.under_matched += 1
            if len(v.examples) < max_examples:
                v.examples.append(f"under-matched ({required} acknowledged before it began): {_op(h, i)}")
    return v


class DropWindows:
    """One model's drops: which stores a read may no longer see."""

    def __init__(self, t0s: np.ndarray, t1s: np.ndarray):
        order = np.argsort(t0s, kind="stable")
        self.t0s = t0s[order].tolist()
        self.latest_end = np.maximum.accumulate(t1s[order]).tolist() if len(order) else []

    def excused_before(self, read_end: int) -> float:
        """Stores that began before this time may have been dropped by a read ending at `read_end`:
        the latest end of a drop that began before the read ended."""
        i = bisect_left(self.t0s, read_end)
        return self.latest_end[i - 1] if i else float("-inf")


def _drop_windows(h: History, models: int) -> list[DropWindows]:
    drops = h.kind == DROP
    return [DropWindows(h.t0[drops & (h.model == m)], h.t1[drops & (h.model == m)]) for m in range(models)]


def check_counters(h: History, stats: dict) -> list[str]:
    """The store's request counters against the history's sums: -> the ones that differ."""
    ok_fetch = (h.kind == FETCH) & (h.result >= 0)
    ok_lookup = (h.kind == LOOKUP) & (h.result >= 0)
    counted_store = (h.kind == STORE) & ((h.result >= 0) | (h.result == FULL))
    expected = {
        "stores": int(np.count_nonzero(counted_store)),
        "stored_pages": int(h.pages[(h.kind == STORE) & (h.result >= 0)].sum()),
        "fetches": int(np.count_nonzero(ok_fetch)),
        "requested_tokens": int(h.n[ok_fetch].sum()),
        "fetched_tokens": int(np.maximum(h.result[ok_fetch] - h.start[ok_fetch], 0).sum()),
        "lookups": int(np.count_nonzero(ok_lookup)),
        "lookup_hit_tokens": int(h.result[ok_lookup].sum()),
    }
    wrong = [f"{name}: the store counted {stats[name]}, the history {want}"
             for name, want in expected.items() if stats[name] != want]
    held = 0
    for name, tier in stats["tiers"].items():
        if tier["bytes"] > tier["capacity_bytes"] or tier["bytes"] < 0 or tier["pages"] < 0:
            wrong.append(f"tier {name}: {tier['pages']} pages, {tier['bytes']} of {tier['capacity_bytes']} bytes")
        held += tier["pages"]
    if held < stats["pages"]:
        wrong.append(f"pages: {stats['pages']} in the tree, {held} held by the tiers")
    return wrong


def _op(h: History, i: int) -> str:
    return (f"{KIND_NAMES[h.kind[i]]} model {h.model[i]} root {h.root[i]} branch {h.branch[i]} "
            f"n {h.n[i]} start {h.start[i]} -> {h.result[i]} [{h.t0[i]}, {h.t1[i]}] ns")
