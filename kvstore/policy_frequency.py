"""Frequency-aware probation policies: how long to keep a page grows with how often its key is stored.

`seen-before` (kvstore/policies.py) splits pages into new keys (probation, evicted first) and
keys stored before (protected, LRU). Measured on the Mooncake sample with `lru-tail` at 2%/5%
of its blocks (bench/reuse_features.py), the number of times a key was stored before predicts
reuse twice as well as "seen or not" (0.036/0.045 bits against 0.017/0.028): a page whose key
was stored once before is served before LRU evicts it 3%/9% of the time, 2-3 times 6%/16%,
4-7 times 13%/23%, 8 or more 27%/55% (new keys: 1%/3%). So these policies keep seen-before's
probation and rank the protected pages by last use *plus a shift* that grows with the key's
store count, in units of the tier's size in pages (one turnover = that many page stores):

- `seen-often`: one turnover per doubling of the count (a page stored 4 times stays two turnovers
  longer than one stored once). Strong: best where popular prompts recur over many turnovers.
- `seen-learned`: half a turnover per unit of (reuse rate of its count class / mean reuse rate - 1),
  the rates learned online from a sampled keys-only LRU shadow (the outcome a page of that class
  would have under LRU at this size, so the estimate does not feed on its own decisions). Milder,
  and it follows the traffic: a class that is not reused more than the mean gets no shift.

Neither is safe alone (frequency keeps stale pages where one fresh reuse is what counts), so the
default `duel-freq` (kvstore/policies.py) plays them against `lru-tail` by set dueling.

Invariants (beyond `TwoSegmentPolicy`'s): `history` holds at most HISTORY_TURNOVERS x pages keys
with their store counts, oldest stored first out; `stamp`/`shift` hold exactly the tier's pages;
the learning shadow holds at most capacity / SAMPLE keys. This module imports no torch.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Callable

from kvstore.index import Node
# policies.py imports this module at its end, once these are defined.
from kvstore.policies import DuelPolicy, LRUTailPolicy, TwoSegmentPolicy

SAMPLE = 8  # a key is in the sampled shadows if its (uniform, blake2b) last byte is 0 mod SAMPLE


def sampled(key: bytes) -> bool:
    return key[-1] % SAMPLE == 0


class _ShiftedLRU(LRUTailPolicy):
    """A segment ranked by its owner's `rank(node)` (tail pages still first)."""

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

    def rank(self, node: Node) -> float:
        return self.stamp[node] + self.shift[node]

    def shift_turnovers(self, node: Node, count: int) -> float:
        """How many turnovers longer than LRU to keep a page whose key was stored `count` times
        before (plus one if it was served)."""
        return count.bit_length() - 1 if count else 0.0

    def insert(self, node: Node) -> None:
        self.tick += 1
        count = self.history.pop(node.key, 0)
        self.history[node.key] = count + 1
        limit = self.HISTORY_TURNOVERS * max(1, len(self._segment) + 1)
        while len(self.history) > limit:
            self.history.popitem(last=False)
        self.capacity_pages = max(self.capacity_pages, len(self._segment) + 1)
        self.stamp[node] = self.tick
        self.shift[node] = self.capacity_pages * self.shift_turnovers(node, count + (1 if node.hits else 0))
        self._admit(node, self.protected if count or node.hits else self.probation)

    def touch(self, node: Node) -> None:
        if node in self._segment:
            self.stamp[node] = self.tick
        super().touch(node)

    def remove(self, node: Node) -> None:
        super().remove(node)
        self.stamp.pop(node, None)
        self.shift.pop(node, None)

    def victim(self) -> Node | None:
        node = self.probation.victim()
        return node if node is not None else self.protected.victim()


class SeenLearnedPolicy(SeenOftenPolicy):
    """`seen-often` with the shift learned per count class from a sampled LRU shadow."""

    name = "seen-learned"
    TURNOVERS_PER_RATIO = 0.5  # shift = this x (class rate / mean rate - 1) turnovers
    HORIZON_TURNOVERS = 16  # the rates forget over ~16 turnovers, as duel's score does
    SERVED = 5  # the class of a page served while held (count classes are 0-4)

    def __init__(self, tier: str):
        super().__init__(tier)
        self.shadow: OrderedDict[bytes, int | None] = OrderedDict()  # key -> class, None once counted
        self.reused: dict[int, float] = {}  # class -> decayed shadow pages reused
        self.outcomes: dict[int, float] = {}  # class -> decayed shadow pages with an outcome
        self.mean = [0.0, 0.0]  # decayed (reused, outcomes) over all classes

    @staticmethod
    def count_class(count: int) -> int:
        return min(count, 8).bit_length()  # 0: new, 1: once, 2: 2-3, 3: 4-7, 4: 8+

    def shift_turnovers(self, node: Node, count: int) -> float:
        cls = self.count_class(count)
        if sampled(node.key):
            self._shadow_reference(node.key, cls)
        return self._shift(cls)

    def _shift(self, cls: int) -> float:
        mean = (self.mean[0] + 1.0) / (self.mean[1] + 2.0)
        rate = (self.reused.get(cls, 0.0) + 2.0 * mean) / (self.outcomes.get(cls, 0.0) + 2.0)  # shrunk to the mean
        return self.TURNOVERS_PER_RATIO * (rate / mean - 1.0)

    def _record(self, cls: int, reused: bool) -> None:
        keep = 1.0 - SAMPLE / (self.HORIZON_TURNOVERS * self.capacity_pages + 1)
        self.reused[cls] = self.reused.get(cls, 0.0) * keep + reused
        self.outcomes[cls] = self.outcomes.get(cls, 0.0) * keep + 1.0
        self.mean[0] = self.mean[0] * keep + reused
        self.mean[1] = self.mean[1] * keep + 1.0

    def _shadow_reference(self, key: bytes, cls: int | None) -> None:
        """LRU over the sampled keys at capacity / SAMPLE: a key's first hit after it entered
        with class `cls` counts as reused, its eviction without one as not."""
        shadow = self.shadow
        if key in shadow:
            before = shadow.pop(key)
            if before is not None:
                self._record(before, True)
            shadow[key] = cls
            return
        shadow[key] = cls
        while len(shadow) > max(1, self.capacity_pages // SAMPLE):
            _, before = shadow.popitem(last=False)
            if before is not None:
                self._record(before, False)

    def touch(self, node: Node) -> None:
        if node in self._segment:
            cls = self.SERVED if node.hits else None
            if sampled(node.key):
                self._shadow_reference(node.key, cls)
            if cls is not None:
                self.shift[node] = self.capacity_pages * self._shift(cls)
        super().touch(node)


class FrequencyDuelPolicy(DuelPolicy):
    """Set dueling among `lru-tail`, `seen-learned` and `seen-often`: how much longer than LRU
    to keep a page whose key is stored often (not at all, the learned shift, one turnover per
    doubling) is the traffic's to say. Shadows on a 1/SAMPLE sample of the keys."""

    name = "duel-freq"
    SAMPLE = SAMPLE
    candidates = (LRUTailPolicy, SeenLearnedPolicy, SeenOftenPolicy)
