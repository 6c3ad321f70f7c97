"""`lru-tail`: leaf-first LRU that evicts tail pages first."""
from __future__ import annotations

from heapq import heapify, heappush
from typing import Any

from kvstore.index import Node
from kvstore.policies.base import PARKED, EvictionPolicy, pop_eligible

# What a subclass may not change: the two heaps below are this ranking's and no other's.
_RANKING = ("priority", "eligible", "leaf_first", "touch_in_place")


class LRUTailPolicy(EvictionPolicy):
    """Leaf-first LRU that evicts tail pages first: the partial last pages of stored sequences.

    A prompt's last page is usually partial, and the next turn of the conversation does not
    extend it: the store writes a *full* page with more tokens beside it (and drops the tail),
    so a tail page is matched again only by a retried prompt; in the Mooncake sample last blocks
    are reused far less often than the others (docs/eviction.md). So among evictable leaves, tail
    pages go first (LRU among them), then full pages in LRU order.

    Only real tails (fewer tokens than a full page, `Node.tail`) rank first: a full last page is
    what the next turn hangs its child under, and a sequence stored a moment ago is served whole.
    No constant; without tail pages this is plain leaf-first LRU (`lru-prefix` in bench/research/).

    Two heaps of (last access, seq, node) stand for the base class's one of (priority, seq, node):
    `_tails` for tail pages, `_heap` for full ones, each entry in the heap of the `tail` its page
    had when it was pushed. Every tail entry ranks before every full one, so popping `_tails`
    until it is empty and then `_heap` pops the entries in the one heap's order, and an int
    compares for the pair (bool, int) on every step of a push or pop. An entry whose page's
    priority changed since (last access, or tail) is re-ranked when it surfaces, as
    `touch_in_place` says. A policy that ranks otherwise derives from `EvictionPolicy`.
    """

    name = "lru-tail"
    leaf_first = True
    touch_in_place = True

    def __init__(self, tier: str):
        super().__init__(tier)
        self._tails: list[tuple[Any, int, Node]] = []  # tail pages' entries; `_heap`: full pages'

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        changed = [name for name in _RANKING if name in vars(cls)]
        if changed:
            raise TypeError(f"{cls.__name__} changes {', '.join(changed)} of lru-tail's two heaps: "
                            "derive from EvictionPolicy to rank otherwise")

    def priority(self, node: Node) -> Any:
        return (not node.tail, node.last_access)

    def _push(self, node: Node) -> None:
        seq = next(self._seq)
        live = self._live
        live[node] = seq
        heap = self._tails if node.tail else self._heap
        heappush(heap, (node.last_access, seq, node))
        if len(heap) > 4 * len(live) + 64:
            self._compact()

    insert = _push

    def _compact(self) -> None:
        live = self._live
        for heap in (self._tails, self._heap):
            heap[:] = [e for e in heap if live.get(e[2]) == e[1]]
            heapify(heap)

    def victim(self) -> Node | None:
        tails, fulls, live, eligible = self._tails, self._heap, self._live, self.eligible
        while True:
            full = not tails
            entry = pop_eligible(fulls if full else tails, live, eligible)
            if entry is None:
                if full:
                    return None
                continue  # no tail page left to evict: the full pages next
            ranked, node = entry
            if ranked != node.last_access or (not node.tail) != full:
                self._push(node)  # touched since it was ranked: rank it where it belongs now
                continue
            live[node] = PARKED  # the caller removes it next (see `EvictionPolicy.victim`)
            return node
