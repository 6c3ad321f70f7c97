"""Research policies: leaf-first LRU (`lru-prefix`) and leaf-first ARC (`arc-prefix`, `arc-tail`).

They are not part of the store: `StoreConfig` offers `lru`, `lru-tail`, `seen-before` and `duel`.
The eviction benchmark replays these through the store's own index and placement
(bench/research/policies.py registers them), so they stay comparable with the product's
policies on any trace. docs/eviction.md has what they measured.
"""
from __future__ import annotations

from collections import OrderedDict

from kvstore.index import Node
from kvstore.policies import EvictionPolicy, LRUTailPolicy, TwoSegmentPolicy


class LRUPrefixPolicy(EvictionPolicy):
    """Leaf-first LRU: only pages with no descendant cached in this tier are candidates,
    least recently used first (as LMCache evicts: no orphaned suffixes). `lru-tail` without
    its tail pages first."""

    name = "lru-prefix"
    leaf_first = True
    touch_in_place = True


class ARCPrefixPolicy(TwoSegmentPolicy):
    """Leaf-first ARC (Megiddo & Modha, FAST '03): admission of one-time pages without a knob.

    Most blocks in real traces are used once (a new conversation's own turn, a one-off
    document), and each would push out a page that is reused. ARC keeps two leaf-first LRU
    segments: `probation` (ARC's recent list: pages stored but never served by a fetch) and
    `protected` (its frequent list: pages served at least once), plus ghost lists of the keys
    each recently evicted. Victims come from `probation` while it is over its target size `p`,
    else from `protected`. A page stored again soon after it left probation (its key is in the
    recent ghosts) says probation was too short: `p` grows; one whose key is in the frequent
    ghosts says the opposite: `p` shrinks. So the share of the tier given to unproven pages is
    learnt from the traffic, not set by a constant; with p = 0 new pages are evicted first (they
    are admitted only to be dropped: the store must hold a page while it is being written, so
    admission is by probation, not refusal).

    A page whose key is in a ghost list comes back straight into `protected` (it was reused).
    Frequency is "served by a fetch" (`Node.hits`, counted once per request by the store), not
    "touched", because the store touches a hit page twice per request (fetch and store).

    Invariants: every page of the tier is in exactly one segment (`_segment`); ghosts hold keys of
    pages not in the tier, each list at most as many as the tier holds pages; 0 <= p <= pages.
    Leaf-first holds across segments (see `TwoSegmentPolicy`).
    """

    name = "arc-prefix"
    segment_policy: type[EvictionPolicy] = LRUPrefixPolicy  # the order within each segment

    def __init__(self, tier: str):
        super().__init__(tier)  # probation: ARC's `recent` (T1); protected: `frequent` (T2)
        self._recent_ghosts: OrderedDict[bytes, None] = OrderedDict()
        self._frequent_ghosts: OrderedDict[bytes, None] = OrderedDict()
        self.p = 0.0  # target number of pages on probation

    def insert(self, node: Node) -> None:
        pages = max(1, len(self._segment))
        rg, fg = self._recent_ghosts, self._frequent_ghosts
        if node.key in rg:
            self.p = min(float(pages), self.p + max(len(fg) / len(rg), 1.0))
            del rg[node.key]
            segment = self.protected
        elif node.key in fg:
            self.p = max(0.0, self.p - max(len(rg) / len(fg), 1.0))
            del fg[node.key]
            segment = self.protected
        else:
            segment = self.protected if node.hits else self.probation
        self._admit(node, segment)

    def remove(self, node: Node) -> None:
        segment = self._segment.get(node)
        super().remove(node)
        if segment is None:
            return
        (self._recent_ghosts if segment is self.probation else self._frequent_ghosts)[node.key] = None
        limit = len(self._segment)
        for ghosts in (self._recent_ghosts, self._frequent_ghosts):
            while len(ghosts) > limit:
                ghosts.popitem(last=False)  # forget the oldest
        self.p = min(self.p, float(limit))

    def victim(self) -> Node | None:
        first, second = ((self.probation, self.protected) if len(self.probation) > self.p
                         else (self.protected, self.probation))
        node = first.victim()
        return node if node is not None else second.victim()


class ARCTailPolicy(ARCPrefixPolicy):
    """`arc-prefix` whose two segments evict tail pages first, as `lru-tail` does."""

    name = "arc-tail"
    segment_policy = LRUTailPolicy
