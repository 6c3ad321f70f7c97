"""How a bench times a call. On a shared machine the least disturbed run is the best one, and a
comparison is made of runs taken in turns, so that a burst of other load falls on both sides."""
from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Callable, Sequence


GC_YOUNG_THRESHOLD = 50_000  # what `kvstore serve` sets, and the README advises an embedder to


def settle_collector() -> None:
    """The collector as `kvstore serve` sets it: the objects made so far frozen, young
    collections rarer (a timed loop allocates; a collection in it is a long outlier)."""
    gc.collect()
    gc.freeze()
    _, middle, old = gc.get_threshold()
    gc.set_threshold(GC_YOUNG_THRESHOLD, middle, old)


def timed(fn: Callable[[], Any]) -> float:
    """Wall seconds of one call."""
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def best_of(fn: Callable[[], Any], repeats: int, warm_up: bool = False) -> float:
    """Best wall seconds of `repeats` calls (after one untimed call with `warm_up`)."""
    if warm_up:
        fn()
    return min(timed(fn) for _ in range(repeats))


def interleaved(subject: Callable[[], Any], baselines: Sequence[Callable[[], Any]], repeats: int,
                on_round: Callable[[], Any] | None = None) -> dict[str, float]:
    """The subject and its baselines in turns, `repeats` rounds (the fastest baseline counts in
    each): the median seconds of each, and the median of the rounds' baseline / subject (> 1: the
    subject is faster), in that order."""
    pairs = []
    for _ in range(repeats):
        pairs.append((timed(subject), min(timed(b) for b in baselines)))
        if on_round is not None:
            on_round()
    return {"subject_s": statistics.median(p[0] for p in pairs), "baseline_s": statistics.median(p[1] for p in pairs),
            "ratio": statistics.median(p[1] / p[0] for p in pairs)}


def per_call_us(fn: Callable[[int], Any], calls: int, repeats: int) -> float:
    """Median over `repeats` runs of the mean µs a call of `calls` calls (fn takes the call's index)."""
    runs = []
    for r in range(repeats):
        t0 = time.perf_counter()
        for i in range(calls):
            fn(r * calls + i)
        runs.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(runs)
