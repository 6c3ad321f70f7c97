"""`lru`: the baseline policy."""
from __future__ import annotations

from kvstore.policies.base import EvictionPolicy


class LRUPolicy(EvictionPolicy):
    """Least recently used page first, whatever its place in the tree.

    Exact LRU down to the page: pages one request used tie on `last_access` and go in the order
    they were used, which only an eager touch keeps (the reference the eviction benchmark and its
    brute-force test compare against). Leaf-first policies touch in place: among one request's
    pages only the deepest can be a leaf, so their ties are not theirs to break."""

    name = "lru"
