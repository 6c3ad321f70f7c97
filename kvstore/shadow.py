"""A shadow cache: a keys-only simulation of one eviction policy over a tier's reference stream.

`DuelPolicy` (kvstore/policies/duel.py) runs two of these side by side, one per candidate policy,
to learn which of the two would hit more on the traffic the tier actually sees. A shadow holds
no bytes and no tree of its own beyond what the policy needs to rank: one `ShadowPage` per key
it holds, linked to the shadow page of its parent key, with the same fields the policies read
from a `Node` (key, tail, hits, last_access, pins, tier_kids).

Invariants:
- `len(pages) <= capacity` after every `reference` (capacity is the caller's, in pages);
- a page's `tier_kids[tier]` counts its children held by this shadow, so the policy's
  leaf-first rule holds here as in the tier: a shadow never drops a page before its children;
- a key is referenced at most once per `tick` (the caller's request-sized unit of time), so a
  fetch and a store of the same page in one request count as one reference, one hit at most.

Sampling (`sample_rate`, `in_sample`): like set dueling in hardware, a duel may send only a
uniform 1/rate of the keys (keys are blake2b digests: their last byte is uniform) through shadows
of 1/rate the size. The rate is a power of two, so a key in the 1/8 sample is in the 1/4 one and
a tier that grows only drops keys from its sample; and it is never so high that a shadow holds
fewer than MIN_SAMPLED_PAGES pages: samples of a few hundred pages put a duel below `lru` on a
generated preset where the full key set did not (docs/eviction.md).

What it does not model: pins (a shadow page is never pinned; the page being referenced is the
newest and has its just-referenced parent above it, so neither is a victim while it is added),
tiers below, bytes (every page is one unit). It imports no torch.
"""
from __future__ import annotations

from typing import Any, Callable


MIN_SAMPLED_PAGES = 1024  # a sampled shadow never holds fewer pages than this (else: sample less)


def sample_rate(capacity_pages: int, most: int) -> int:
    """The largest power of two <= `most` that leaves a shadow of `capacity_pages` / rate at
    least MIN_SAMPLED_PAGES pages (1: every key)."""
    rate = 1
    while rate * 2 <= most and capacity_pages // (rate * 2) >= MIN_SAMPLED_PAGES:
        rate *= 2
    return rate


def in_sample(key: bytes, rate: int) -> bool:
    return key[-1] % rate == 0


class ShadowPage:
    """The fields of a `Node` that eviction policies read, for a page that is only simulated."""

    __slots__ = ("key", "parent", "tail", "hits", "last_access", "pins", "tier_kids", "depth", "tick",
                 "__weakref__")

    def __init__(self, key: bytes, parent: "ShadowPage | None", tail: bool, last_access: int, tick: int,
                 tier: str):
        self.key = key
        self.parent = parent
        self.tail = tail
        self.hits = 0  # references while held by the shadow, after the first (ARC reads it)
        self.last_access = last_access
        self.pins = 0  # never pinned (see the module docstring)
        self.tier_kids: dict[str, int] = {tier: 0}  # one tier: the shadow's (policies read it so)
        self.depth: int = 0 if parent is None else parent.depth + 1
        self.tick = tick  # the last tick it was referenced in


class ShadowCache:
    """One policy (made by `make_policy(tier)`) over at most `capacity` simulated pages.

    `reference` is called for every page a request stores or uses, once per shadow: it calls the
    policy's methods bound once here, and skips a touch the policy says changes nothing
    (`touches_nothing`: one that touches in place)."""

    # A policy is typed Any here: it ranks `ShadowPage`s, which stand in for the index's `Node`s
    # (the fields policies read), not `Node`s themselves.
    def __init__(self, tier: str, make_policy: Callable[[str], Any]):
        self.tier = tier
        self.policy = policy = make_policy(tier)
        self.pages: dict[bytes, ShadowPage] = {}
        touches_nothing = getattr(policy, "touches_nothing", None)
        self._touch = None if touches_nothing is not None and touches_nothing() else policy.touch
        self._insert = policy.insert
        self._victim = policy.victim
        self._remove = policy.remove
        self._update = policy.update

    def __len__(self) -> int:
        return len(self.pages)

    def reference(self, key: bytes, parent_key: bytes | None, tail: bool, last_access: int, tick: int,
                  capacity: int) -> bool:
        """The tier's page `key` (a `Node`'s fields) was stored or used: True if the shadow held
        it (a hit). A miss adds the key, then evicts by the policy down to `capacity` pages."""
        pages = self.pages
        page = pages.get(key)
        if page is not None:
            if page.tick == tick:
                return False  # the same request again (its fetch, then its store)
            page.tick = tick
            page.hits += 1
            page.last_access = last_access
            touch = self._touch
            if touch is not None:
                touch(page)
            return True
        tier = self.tier
        parent = pages.get(parent_key) if parent_key is not None else None
        page = pages[key] = ShadowPage(key, parent, tail, last_access, tick, tier)
        if parent is not None:
            parent.tier_kids[tier] += 1
        self._insert(page)
        if len(pages) > capacity:
            victim_of, remove, update = self._victim, self._remove, self._update
            while len(pages) > capacity:
                victim = victim_of()
                if victim is None:
                    break
                # Drop it: out of the policy and the shadow; its parent, if the shadow still
                # holds that very page, has one child fewer (and may be a leaf now).
                remove(victim)
                del pages[victim.key]
                up: ShadowPage | None = victim.parent
                if up is not None and pages.get(up.key) is up:
                    kids = up.tier_kids
                    left = kids[tier] - 1
                    kids[tier] = left
                    if left == 0:
                        update(up)
        return False
