"""Belady's offline optimum as an eviction policy: the reference line of the benchmark.

Classic farthest-next-use over blocks: the victim is the page whose next use (the index of the
next request that contains it, from the replayer's `NextUse` oracle) is farthest in the future;
pages never used again go first. Ties go to the deeper page.

Why this is the right reference for prefix-chained traces although a hit needs the leading run:
a request that uses a page uses all its ancestors, so a page's next use is never earlier than
its parent's. Farthest-next-use therefore can always pick a leaf, and this policy is leaf-first
without losing anything: what it keeps is always a prefix-closed tree, so every cached block of
a request is in its leading run and per-block hits equal leading-run hits. It is the classic
reference, optimal for one-block requests without bypass; with multi-block pinned requests it
is a near-optimal upper line, not a proven bound (the tests check it beats the online policies).

Only the benchmark uses it (it needs the future); it is not in POLICIES.

`OptGen` is the same optimum seen from the past (Hawkeye's OPTgen): it needs no future, and
tells for each reuse, once it happens, whether MIN would have kept the block over it.
`bench/reuse_features.py --optgen` labels pages with it: what a Hawkeye predictor learns from.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

import numpy as np

from kvstore.index import Node
from kvstore.policies import EvictionPolicy

from bench.research.replay import NEVER, NextUse


class BeladyPolicy(EvictionPolicy):
    name = "belady"
    leaf_first = True

    def __init__(self, tier: str, oracle: NextUse):
        super().__init__(tier)
        self.oracle = oracle

    def priority(self, node: Node) -> Any:
        # Smaller is evicted first: the farthest next use, then the deepest page.
        return (-self.oracle.of.get(node.key, NEVER), -node.depth)


WINDOW_TURNOVERS = 8  # Hawkeye's history: 8x the cache, in references


class OptGen:
    """OPTgen (Jain & Lin, ISCA 2016): Belady's decisions over a window of past references.

    By the time a key is referenced again its whole reuse interval is in the past, so MIN's
    decision for it (with bypass) can be computed online: MIN keeps the key over [previous
    reference, this one) iff at every step in it fewer than `capacity` keys were already kept
    (`occupancy`); if so the reuse is a hit and every step of the interval holds one more key.
    Deciding intervals in the order their ends arrive is what makes this MIN: a later-ending
    interval never takes a slot from an earlier-ending one. Time is one step per reference.

    A key not referenced again within WINDOW_TURNOVERS x capacity steps counts as a miss (Hawkeye's
    sampler ages it out the same way). Each outcome goes to `train(tag, hit)` with the tag the
    caller gave the key's *previous* reference (Hawkeye's PC): that is when a policy had to decide.
    Blocks are keys: MIN here may keep a child without its parent (prefixes are not modelled).

    Invariants: `last` holds the keys last referenced within the window, oldest first; after
    each reference every occupancy entry in the window is <= capacity; memory is O(window).
    """

    def __init__(self, train: Callable[[Any, bool], None]):
        self.train = train
        self.occupancy = np.zeros(4096, dtype=np.int32)  # step - base -> keys MIN keeps over that step
        self.base = 0  # the step of occupancy[0]
        self.now = 0  # the next reference's step
        self.last: OrderedDict[bytes, tuple[int, Any]] = OrderedDict()  # key -> (step, tag) of its last reference

    def reference(self, key: bytes, tag: Any, capacity: int) -> None:
        """`key` is referenced now (tagged `tag`), in a cache of `capacity` keys."""
        window = WINDOW_TURNOVERS * capacity
        now = self.now
        self.now = now + 1
        previous = self.last.pop(key, None)
        if previous is not None:
            span = self.occupancy[previous[0] - self.base:now - self.base]
            # A window that shrank (capacity is the caller's, and may change) forgets older steps.
            hit = previous[0] > now - window and (span.size == 0 or int(span.max()) < capacity)
            if hit:
                span += 1
            self.train(previous[1], hit)
        self.last[key] = (now, tag)
        last = self.last
        while last:  # keys not referenced again within the window: misses
            oldest_key, (step, oldest_tag) = next(iter(last.items()))
            if step > now - window:
                break
            del last[oldest_key]
            self.train(oldest_tag, False)
        self._slide(now + 1 - window)

    def _slide(self, oldest: int) -> None:
        """Make room for step `self.now`: drop the steps before `oldest` (no key in `last` is
        older), and grow the vector if the window itself needs more."""
        size = self.occupancy.size
        if self.now - self.base < size:
            return
        drop = max(0, oldest - self.base)
        if drop:
            kept = self.occupancy[drop:].copy()
            self.occupancy[:kept.size] = kept
            self.occupancy[kept.size:] = 0
            self.base += drop
        if self.now - self.base >= size:
            grown = np.zeros(2 * size, dtype=np.int32)
            grown[:size] = self.occupancy
            self.occupancy = grown
