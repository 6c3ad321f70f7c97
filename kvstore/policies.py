"""Eviction policies: small strategy classes that pick a victim in one tier.

A policy instance belongs to one tier. The store (placement) tells it when a page enters the
tier (`insert`), is used (`touch`), leaves (`remove`), or may have changed eligibility
(`update`: unpinned, lost its last child in the tier); `victim()` returns the page to evict next.

Each policy keeps a heap of (priority, seq, node) with lazy invalidation: a node's live entry is
the one whose seq matches `self._live[node]`; stale entries are skipped when popped. Ineligible
nodes (pinned, or not a leaf for leaf-first policies) are dropped from the heap when popped and
pushed back by `update`, so a victim search never loops over them twice.

Policies never touch tiers or the tree; they only rank pages. This module imports no torch.
"""
from __future__ import annotations

import heapq
import itertools
from typing import Any

from kvstore.index import Node


class EvictionPolicy:
    """Base: LRU order over the pages of one tier. Subclasses override `priority`/`eligible`."""

    name = "base"
    leaf_first = False

    def __init__(self, tier: str):
        self.tier = tier
        self._heap: list[tuple[Any, int, Node]] = []
        self._live: dict[Node, int] = {}
        self._seq = itertools.count()

    def priority(self, node: Node) -> Any:
        """Smaller is evicted first."""
        return node.last_access

    def eligible(self, node: Node) -> bool:
        if node.pins:
            return False
        # Leaf-first: never evict a page while a descendant is still cached in this tier, so no
        # tier ever holds a suffix whose prefix it dropped (orphans are unreachable by matching).
        return not (self.leaf_first and node.tier_kids.get(self.tier, 0))

    def _push(self, node: Node) -> None:
        seq = next(self._seq)
        self._live[node] = seq
        heapq.heappush(self._heap, (self.priority(node), seq, node))
        if len(self._heap) > 4 * len(self._live) + 64:
            self._compact()

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if self._live.get(e[2]) == e[1]]
        heapq.heapify(self._heap)

    def insert(self, node: Node) -> None:
        self._push(node)

    def touch(self, node: Node) -> None:
        if node in self._live:
            self._push(node)

    def update(self, node: Node) -> None:
        if node in self._live:
            self._push(node)

    def remove(self, node: Node) -> None:
        self._live.pop(node, None)

    def __len__(self) -> int:
        return len(self._live)

    def victim(self) -> Node | None:
        while self._heap:
            _, seq, node = heapq.heappop(self._heap)
            if self._live.get(node) != seq:
                continue  # stale entry
            if not self.eligible(node):
                self._live[node] = -1  # parked until `update` pushes it again
                continue
            self._push(node)  # stays ranked until placement actually removes it
            return node
        return None


class LRUPolicy(EvictionPolicy):
    """Least recently used page first, whatever its place in the tree."""

    name = "lru"


class LRUPrefixPolicy(EvictionPolicy):
    """Leaf-first LRU: only pages with no descendant cached in this tier are candidates,
    least recently used first (LMCache issue #1116: no orphaned suffixes)."""

    name = "lru-prefix"
    leaf_first = True


POLICIES: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    LRUPrefixPolicy.name: LRUPrefixPolicy,
}
