"""Frequency-aware probation policies: how long to keep a page grows with how often its key is stored.

Research policies, not part of the store (`StoreConfig` offers `lru`, `lru-tail`, `seen-before`
and `duel`): bench/research/policies.py registers them with the eviction benchmark's replay, and
docs/eviction.md has what they measured.

`seen-before` (kvstore/policies/seen_before.py) splits pages into new keys (probation, evicted first) and
keys stored before (protected, LRU). On the Mooncake sample (bench/research/reuse_features.py) the number
of times a key was stored before predicts reuse better than "seen or not", and a page is the
likelier to be served before LRU evicts it the more often its key was stored. So these policies
keep seen-before's probation and rank the protected pages by last use *plus a shift* that grows
with the key's store count, in units of the tier's size in pages (one turnover = that many page
stores):

- `seen-often`: one turnover per doubling of the count (a page stored 4 times stays two turnovers
  longer than one stored once; each request a held page serves counts as a store). Strong: best
  where popular prompts recur over many turnovers.
- `seen-learned`: ln(reuse rate of its class / mean reuse rate) turnovers, the rates learned
  online from a sampled keys-only LRU shadow (the outcome a page of that class would have under
  LRU at this size, so the estimate does not feed on its own decisions). Why the log: if a page's
  chance of being needed is its class's rate times a liveness that decays by e per turnover since
  its last use, the page least likely to be needed next is the one with the lowest
  ln(rate) - age / turnover, i.e. LRU order shifted by ln(rate ratio) turnovers, and an additive
  shift is the only form whose order does not change as time passes (what a heap needs). It
  follows the traffic: a class reused less than the mean is shifted towards eviction.

Neither is safe alone (frequency keeps stale pages where one fresh reuse is what counts), so
`duel-freq` plays them against `lru-tail` by set dueling. It is not the default: on the Mooncake
sample it beats `duel` at one capacity but not at the others (docs/eviction.md); what a three-way
duel gains in choice it loses in switching.

Invariants (beyond `TwoSegmentPolicy`'s): `history` holds at most HISTORY_TURNOVERS x pages keys
with their store counts, oldest stored first out; `stamp`/`shift`/`stores` hold exactly the
tier's pages; the learning shadow holds at most capacity / rate keys. This module imports no torch.
"""
from __future__ import annotations

import math
from collections import OrderedDict
from typing import Any, Callable

from kvstore.index import Node
from kvstore.policies import DuelPolicy, EvictionPolicy, LRUTailPolicy, TwoSegmentPolicy
from kvstore.shadow import in_sample, sample_rate

SAMPLE = DuelPolicy.SAMPLE  # at most 1/8 of the keys through the learning shadow (shadow.sample_rate)


class _ShiftedLRU(EvictionPolicy):
    """A leaf-first segment ranked by its owner's `rank(node)`, tail pages first (`lru-tail`'s
    order with a shift: one heap of the base class, since the rank is not a last access)."""

    leaf_first = True
    touch_in_place = False  # a learned shift can lower a page's rank: touches re-rank it now

    def __init__(self, tier: str, rank: Callable[[Node], float]):
        super().__init__(tier)
        self.rank = rank

    def priority(self, node: Node) -> Any:
        return (not node.tail, self.rank(node))


class SeenOftenPolicy(TwoSegmentPolicy):
    """seen-before's probation; protected pages ranked by last use + a shift in turnovers of
    log2(store count): see the module docstring."""

    name = "seen-often"
    HISTORY_TURNOVERS = 10  # seen-before's window (TinyLFU's sample: 10x the cache)

    def __init__(self, tier: str):
        super().__init__(tier)
        self.probation, self.protected = _ShiftedLRU(tier, self.rank), _ShiftedLRU(tier, self.rank)
        self.history: OrderedDict[bytes, int] = OrderedDict()  # key -> stores in the window
        self.tick = 0  # page stores into the tier
        self.capacity_pages = 1  # the most pages the tier has held: one turnover, in ticks
        self.stamp: dict[Node, int] = {}  # tick of the page's last store or use
        self.shift: dict[Node, float] = {}  # ticks added to its stamp
        self.stores: dict[Node, int] = {}  # times its key was stored within the window before

    def rank(self, node: Node) -> float:
        return self.stamp[node] + self.shift[node]

    def shift_turnovers(self, node: Node, count: int) -> float:
        """How many turnovers longer than LRU to keep a page whose key was stored `count` times
        before (plus one if it was served)."""
        return count.bit_length() - 1 if count else 0.0

    def served_turnovers(self, node: Node) -> float:
        """The same once the page has been served: each request it served counts as a store (a
        page kept and hit is needed as often as one dropped and stored again)."""
        return self.shift_turnovers(node, self.stores[node] + node.hits)

    def insert(self, node: Node) -> None:
        self.tick += 1
        count = self.history.pop(node.key, 0)
        self.history[node.key] = count + 1
        limit = self.HISTORY_TURNOVERS * max(1, len(self._segment) + 1)
        while len(self.history) > limit:
            self.history.popitem(last=False)
        self.capacity_pages = max(self.capacity_pages, len(self._segment) + 1)
        self.stamp[node] = self.tick
        self.stores[node] = count
        self.shift[node] = self.capacity_pages * self.shift_turnovers(node, count + (1 if node.hits else 0))
        self._admit(node, self.protected if count or node.hits else self.probation)

    def touch(self, node: Node) -> None:
        if node in self._segment:
            self.stamp[node] = self.tick
            if node.hits:
                self.shift[node] = self.capacity_pages * self.served_turnovers(node)
        super().touch(node)

    def remove(self, node: Node) -> None:
        super().remove(node)
        self.stamp.pop(node, None)
        self.shift.pop(node, None)
        self.stores.pop(node, None)

    def victim(self) -> Node | None:
        node = self.probation.victim()
        return node if node is not None else self.protected.victim()


class SeenLearnedPolicy(SeenOftenPolicy):
    """`seen-often` with the shift learned per count class from a sampled LRU shadow."""

    name = "seen-learned"
    HORIZON_TURNOVERS = 16  # the rates forget over ~16 turnovers, as duel's score does
    SERVED = 5  # the class of a page served while held (count classes are 0-4)

    def __init__(self, tier: str):
        super().__init__(tier)
        # Sampled key -> (class it entered with, None once its outcome is counted; tick of its
        # last reference): a fetch and a store of one request are one reference, as in ShadowCache.
        self.shadow: OrderedDict[bytes, tuple[int | None, int]] = OrderedDict()
        self.reused: dict[int, float] = {}  # class -> decayed shadow pages reused
        self.outcomes: dict[int, float] = {}  # class -> decayed shadow pages with an outcome
        self.mean = [0.0, 0.0]  # decayed (reused, outcomes) over all classes
        self.rate = 1  # 1/rate of the keys go through the shadow

    @staticmethod
    def count_class(count: int) -> int:
        return min(count, 8).bit_length()  # 0: new, 1: once, 2: 2-3, 3: 4-7, 4: 8+

    def shift_turnovers(self, node: Node, count: int) -> float:
        return self._shift(self.count_class(count))

    def served_turnovers(self, node: Node) -> float:
        return self._shift(self.SERVED)

    def _shift(self, cls: int) -> float:
        mean = (self.mean[0] + 1.0) / (self.mean[1] + 2.0)
        rate = (self.reused.get(cls, 0.0) + 2.0 * mean) / (self.outcomes.get(cls, 0.0) + 2.0)  # shrunk to the mean
        return math.log(rate / mean)

    def _record(self, cls: int, reused: bool) -> None:
        keep = 1.0 - self.rate / (self.HORIZON_TURNOVERS * self.capacity_pages + 1)
        self.reused[cls] = self.reused.get(cls, 0.0) * keep + reused
        self.outcomes[cls] = self.outcomes.get(cls, 0.0) * keep + 1.0
        self.mean[0] = self.mean[0] * keep + reused
        self.mean[1] = self.mean[1] * keep + 1.0

    def _shadow_reference(self, key: bytes, cls: int | None) -> None:
        """LRU over the sampled keys at capacity / rate: a key's first hit after it entered
        with class `cls` counts as reused, its eviction without one as not."""
        shadow = self.shadow
        if key in shadow:
            before, tick = shadow.pop(key)
            if tick == self.tick:  # the same request again (its fetch, then its store)
                shadow[key] = (before, tick)
                return
            if before is not None:
                self._record(before, True)
            shadow[key] = (cls, self.tick)
            return
        shadow[key] = (cls, self.tick)
        while len(shadow) > max(1, self.capacity_pages // self.rate):
            _, (before, _) = shadow.popitem(last=False)
            if before is not None:
                self._record(before, False)

    def insert(self, node: Node) -> None:
        self.rate = sample_rate(max(self.capacity_pages, len(self._segment) + 1), SAMPLE)
        if in_sample(node.key, self.rate):
            count = self.history.get(node.key, 0) + (1 if node.hits else 0)
            self._shadow_reference(node.key, self.count_class(count))
        super().insert(node)

    def touch(self, node: Node) -> None:
        if node in self._segment and in_sample(node.key, self.rate):
            self._shadow_reference(node.key, self.SERVED if node.hits else None)
        super().touch(node)


class FrequencyDuelPolicy(DuelPolicy):
    """Set dueling among `lru-tail`, `seen-learned` and `seen-often`: how much longer than LRU
    to keep a page whose key is stored often (not at all, the learned shift, one turnover per
    doubling) is the traffic's to say. Shadows on a sample of at most 1/SAMPLE of the keys."""

    name = "duel-freq"
    candidates = (LRUTailPolicy, SeenLearnedPolicy, SeenOftenPolicy)
