"""Eviction policies: small strategy classes that pick a victim in one tier, one per file.

A policy instance belongs to one tier. The store (placement) tells it when a page enters the
tier (`insert`), is used (`touch`), leaves (`remove`), or may have changed eligibility
(`update`: unpinned, lost its last child in the tier); `victim()` returns the page to evict next,
which the caller then removes. Every policy ranks in the heap of `base.EvictionPolicy`
(`lru-tail` in two heaps of its own); the research policies of bench/research/ derive from the
same classes.

- base.py: `EvictionPolicy`, LRU order and the heap with lazy invalidation;
- lru.py: `lru`, the baseline;
- lru_tail.py: `lru-tail`, leaf-first LRU, tail pages first;
- two_segment.py: probation and protected segments;
- seen_before.py: `seen-before`, new keys on probation;
- duel.py: `duel`, the default, set dueling between `lru-tail` and `seen-before`.

Policies never touch tiers or the tree; they only rank pages. This package imports no torch.
"""
from __future__ import annotations

from kvstore.policies.base import EvictionPolicy
from kvstore.policies.duel import DuelPolicy
from kvstore.policies.lru import LRUPolicy
from kvstore.policies.lru_tail import LRUTailPolicy
from kvstore.policies.seen_before import SeenBeforePolicy
from kvstore.policies.two_segment import TwoSegmentPolicy

__all__ = ["POLICIES", "DuelPolicy", "EvictionPolicy", "LRUPolicy", "LRUTailPolicy", "SeenBeforePolicy",
           "TwoSegmentPolicy"]

# What `StoreConfig(policy=...)` offers: the default `duel`, the two rules it chooses between, and
# `lru` as the baseline. The research policies (leaf-first LRU, ARC, frequency-aware probation)
# live in bench/research/ and run through the eviction benchmark's replay.
POLICIES: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    LRUTailPolicy.name: LRUTailPolicy,
    SeenBeforePolicy.name: SeenBeforePolicy,
    DuelPolicy.name: DuelPolicy,
}
