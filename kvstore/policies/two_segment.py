"""`TwoSegmentPolicy`: probation and protected, the frame of `seen-before` and the research ARCs."""
from __future__ import annotations

from kvstore.index import Node
from kvstore.policies.base import EvictionPolicy
from kvstore.policies.lru_tail import LRUTailPolicy


class TwoSegmentPolicy(EvictionPolicy):
    """Leaf-first policy over two segments, each ranked by `segment_policy`: `probation` and
    `protected`. Subclasses choose the segment a page enters (`insert`) and the order victims are
    taken in (`victim`); a page served by a fetch while on probation (`Node.hits`, counted once
    per request by the store) moves to `protected`.

    Invariants: every page of the tier is in exactly one segment (`_segment`); leaf-first holds
    across segments (eligibility is the tier's, not the segment's), so a protected parent with a
    child on probation waits for the child, and a segment whose pages are all parked yields.
    """

    leaf_first = True
    segment_policy: type[EvictionPolicy] = LRUTailPolicy

    def __init__(self, tier: str):
        super().__init__(tier)
        self.probation = self.segment_policy(tier)
        self.protected = self.segment_policy(tier)
        self._segment: dict[Node, EvictionPolicy] = {}

    def __len__(self) -> int:
        return len(self._segment)

    def _admit(self, node: Node, segment: EvictionPolicy) -> None:
        self._segment[node] = segment
        segment.insert(node)

    def touch(self, node: Node) -> None:
        segment = self._segment.get(node)
        if segment is None:
            return
        if segment is self.probation and node.hits:
            segment.remove(node)  # served: off probation
            self._admit(node, self.protected)
        else:
            segment.touch(node)

    def update(self, node: Node) -> None:
        segment = self._segment.get(node)
        if segment is not None:
            segment.update(node)

    def remove(self, node: Node) -> None:
        segment = self._segment.pop(node, None)
        if segment is not None:
            segment.remove(node)
