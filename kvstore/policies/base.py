"""`EvictionPolicy`: LRU order over the pages of one tier, and the heap every policy ranks in.

The heap holds (priority, seq, node) with lazy invalidation: a node's live entry is the one whose
seq matches `_live[node]`; stale entries are skipped when popped. Ineligible nodes (pinned, or
not a leaf for leaf-first policies) are dropped from the heap when popped ("parked", seq -1) and
pushed back by `update`, so a victim search never loops over them twice. Seqs are unique within a
policy, so entries never tie: the order victims come out in depends only on which entries are in
the heap, never on the heap's layout, and compacting it (dropping stale entries) changes nothing.

A policy whose priority only grows while a page is used (leaf-first LRU: last use only moves
forward) sets `touch_in_place`: a touch leaves the page's entry as it is, ranked at an older
priority than its own. Such an entry can only surface early, never late, so `victim` re-ranks an
entry whose priority went stale when it surfaces and goes on; a surfaced entry whose priority is
current is a true minimum, since every other entry ranks its page at or below that page's
priority. (Pages of equal priority may come out in another order than eager pushes would give.)
A fetch touches every page it serves, in every tier's policy and shadow, so the touch is the hot
call: in place, it is a dict lookup instead of a heap push, and callers that know it changes
nothing (`touches_nothing`) skip it.
"""
from __future__ import annotations

import itertools
from heapq import heapify, heappop, heappush
from typing import Any, Callable

from kvstore.index import Node

PARKED = -1  # `_live[node]` of a node with no entry in the heap until `update` pushes it again


class EvictionPolicy:
    """Base: LRU order over the pages of one tier. Subclasses override `priority`/`eligible`."""

    name = "base"
    leaf_first = False
    touch_in_place = False  # True only where `priority` never decreases over a page's life

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
        live = self._live
        live[node] = seq
        heap = self._heap
        heappush(heap, (self.priority(node), seq, node))
        if len(heap) > 4 * len(live) + 64:
            self._compact()

    def _compact(self) -> None:
        # In place: `victim` holds the heap in a local while it pushes.
        live, heap = self._live, self._heap
        heap[:] = [e for e in heap if live.get(e[2]) == e[1]]
        heapify(heap)

    def insert(self, node: Node) -> None:
        self._push(node)

    def touch(self, node: Node) -> None:
        if node in self._live and not self.touch_in_place:
            self._push(node)

    def touches_nothing(self) -> bool:
        """True if `touch` never changes this policy (it touches in place, with the base
        `touch`): callers on the hot path skip the call."""
        return self.touch_in_place and type(self).touch is EvictionPolicy.touch

    def update(self, node: Node) -> None:
        # Only a parked node needs a new entry: an eligible one's priority has not changed (a
        # store unpins every page of its request, so re-pushing all of them was most of the work).
        if self._live.get(node) == PARKED:
            self._push(node)

    def remove(self, node: Node) -> None:
        self._live.pop(node, None)

    def learn_later(self, on: bool) -> None:
        """Policies that learn from the reference stream beside ranking pages (`duel`) may hold
        that work until `catch_up`; the ranking itself is always current. Others: nothing to do."""

    def catch_up(self) -> None:
        """Do the learning `learn_later` held back."""

    def __len__(self) -> int:
        return len(self._live)

    def victim(self) -> Node | None:
        heap, live = self._heap, self._live
        eligible, priority, in_place = self.eligible, self.priority, self.touch_in_place
        while (entry := pop_eligible(heap, live, eligible)) is not None:
            ranked, node = entry
            if in_place and ranked != priority(node):
                self._push(node)  # touched since it was ranked: rank it where it belongs now
                continue
            # Every caller removes the victim from the tier next (placement evicts it, a shadow
            # drops it): ranking it again would cost a push now and a stale pop later. Parked,
            # so an `update` ranks it again should it stay.
            live[node] = PARKED
            return node
        return None


def pop_eligible(heap: list[tuple[Any, int, Node]], live: dict[Node, int],
                 eligible: Callable[[Node], bool]) -> tuple[Any, Node] | None:
    """Pop `heap` down to its first live entry whose node is eligible: (its rank, the node), or
    None once the heap is empty. Stale entries are dropped; ineligible nodes are parked."""
    while heap:
        ranked, seq, node = heappop(heap)
        if live.get(node) != seq:
            continue  # stale entry
        if not eligible(node):
            live[node] = PARKED
            continue
        return ranked, node
    return None
