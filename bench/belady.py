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
"""
from __future__ import annotations

from typing import Any

from kvstore.index import Node
from kvstore.policies import EvictionPolicy

from bench.replay import NEVER, NextUse


class BeladyPolicy(EvictionPolicy):
    name = "belady"
    leaf_first = True

    def __init__(self, tier: str, oracle: NextUse):
        super().__init__(tier)
        self.oracle = oracle

    def priority(self, node: Node) -> Any:
        # Smaller is evicted first: the farthest next use, then the deepest page.
        return (-self.oracle.of.get(node.key, NEVER), -node.depth)
