"""`seen-before`: pages whose key is new to the tier are evicted before the rest."""
from __future__ import annotations

from collections import OrderedDict

from kvstore.index import Node
from kvstore.policies.two_segment import TwoSegmentPolicy


class SeenBeforePolicy(TwoSegmentPolicy):
    """Leaf-first probation: pages whose key is new to the tier are evicted before the rest.

    Most blocks of real traces are used once, and a block used once tells nothing of its future,
    while a block used twice is usually used again (the Mooncake sample's reuse rates:
    docs/eviction.md). So a page enters `probation` unless its key was stored into this tier
    within the last HISTORY_TURNOVERS x (pages held) stored keys, or it is served while held;
    then it is `protected`. Victims come from probation (tail pages first, then LRU) while it
    has an evictable page, else from protected (same order). The history is TinyLFU's sample
    window: 10 times the cache (Einziger et al., ACM ToS 2017; Caffeine's default), long enough
    to see a prompt come back after the tier has turned over several times, short enough to
    forget. It costs one key per entry, not a page.

    Invariants: every page of the tier is in exactly one segment; `history` holds at most
    HISTORY_TURNOVERS x max(pages, 1) keys, oldest stored first out; leaf-first holds across
    segments (a protected parent waits for its probationary child).
    """

    name = "seen-before"
    HISTORY_TURNOVERS = 10

    def __init__(self, tier: str):
        super().__init__(tier)  # probation: key not stored here recently, never served
        self.history: OrderedDict[bytes, None] = OrderedDict()  # keys stored, oldest first

    def insert(self, node: Node) -> None:
        key, history = node.key, self.history
        if key in history:
            history.move_to_end(key)
            segment = self.protected
        else:
            history[key] = None  # a new key goes in last
            segment = self.protected if node.hits else self.probation
        limit = self.HISTORY_TURNOVERS * (len(self._segment) + 1)  # pages held, this one included
        while len(history) > limit:
            history.popitem(last=False)
        self._admit(node, segment)

    def victim(self) -> Node | None:
        node = self.probation.victim()
        return node if node is not None else self.protected.victim()
