"""`duel`, the default: set dueling between `lru-tail` and `seen-before` by shadow caches."""
from __future__ import annotations

from kvstore.index import Node
from kvstore.policies.base import EvictionPolicy
from kvstore.policies.lru_tail import LRUTailPolicy
from kvstore.policies.seen_before import SeenBeforePolicy
from kvstore.shadow import ShadowCache, in_sample, sample_rate


class DuelPolicy(EvictionPolicy):
    """Set dueling (Qureshi et al., ISCA '07) between `lru-tail` and `seen-before`, by shadow caches.

    No single rule wins on every traffic: `seen-before` protects pages whose key comes back,
    which pays where prompts recur many times (the Mooncake sample), and loses where what matters
    is the first reuse of fresh pages (chat: turn N+1 reuses turn N's prompt once; documents with
    one follow-up); `lru-tail` is the reverse. So this policy keeps every candidate's ranking of
    the tier's pages and, beside them, one keys-only `ShadowCache` per candidate that replays the
    tier's own reference stream at the tier's size. Each candidate's `scores` entry counts its
    shadow's hits, decayed; victims come from the candidate with the highest score (the first,
    `lru-tail`, on a tie: it is never below LRU on the traces we have).

    Scores decay by 1/(HORIZON_TURNOVERS x pages) per reference, so they compare the last ~16
    turnovers of the tier: a switch takes about one turnover to change what the tier holds, so
    the comparison must span many of them or the tier follows neither candidate (a short horizon
    lost to both candidates on a generated preset: docs/eviction.md). The shadows' size is the
    most pages the tier has held (its capacity in pages once it has filled); a page stored and
    used in one request is one reference (`tick` counts the pages stored into the tier, and none
    is stored between a request's fetch and its store).

    With SAMPLE > 1, once the tier is large enough (`shadow.sample_rate`: every shadow keeps at
    least MIN_SAMPLED_PAGES pages) only a uniform 1/rate of the keys, rate <= SAMPLE, go through
    the shadows, each at 1/rate of the tier's size, as set dueling samples sets: the shadows cost
    1/rate, and a shadow page whose parent is not sampled is a root of its own (leaf-first holds
    within the sample only).

    With `learn_later(True)` (the sidecar), references are held in `pending` and replayed
    through the shadows by `catch_up`, which the sidecar calls once an answer is on the wire:
    the shadows are most of this policy's cost over `lru-tail`'s (docs/performance.md), and only
    which candidate leads depends on them, never which pages the rankings hold. The leader then
    lags by the references not yet replayed, a request's worth against a horizon of ~16
    turnovers. At most MAX_PENDING are held: a store used in-process with nobody calling
    `catch_up` replays them inline in batches.

    Invariants: every candidate ranks exactly the tier's pages (every call goes to all); each
    shadow holds at most `capacity_pages` / `rate` keys; leaf-first and pins hold because the
    victim is always one candidate's, and all are leaf-first; `pending` is None unless learning
    later, and holds fewer than MAX_PENDING references. Cost: one ranking per candidate plus the
    shadows' keys (and their own key histories) per tier instead of one ranking.
    """

    name = "duel"
    leaf_first = True
    HORIZON_TURNOVERS = 16
    SAMPLE = 8  # at most 1/8 of the keys through the shadows (none sampled below 2048 pages)
    candidates: tuple[type[EvictionPolicy], ...] = (LRUTailPolicy, SeenBeforePolicy)
    MAX_PENDING = 4096  # shadow references held for `catch_up` (learn_later) before replaying inline

    def __init__(self, tier: str):
        super().__init__(tier)
        self.rankings = [make(tier) for make in self.candidates]
        self.shadows = [ShadowCache(tier, make) for make in self.candidates]
        self.capacity_pages = 0  # the most pages the tier has held
        self.tick = 0
        self.scores = [0.0] * len(self.candidates)  # decayed shadow hits per candidate
        self._leader = 0
        self.rate = 1  # 1/rate of the keys go through the shadows
        # (key, parent key, tail, last access, tick) of references not yet through the shadows
        self.pending: list[tuple[bytes, bytes | None, bool, int, int]] | None = None
        # Every call goes to every ranking: their bound methods, looked up once. A touch changes
        # only the rankings that rank on it (not those that touch in place): a fetch touches every
        # page it serves, so the others are not called at all.
        self._inserts = [r.insert for r in self.rankings]
        self._touches = [r.touch for r in self.rankings if not r.touches_nothing()]
        self._updates = [r.update for r in self.rankings]
        self._removes = [r.remove for r in self.rankings]
        self._references = [s.reference for s in self.shadows]
        self._shadow_size()

    def _shadow_size(self) -> None:
        """The shadows' capacity and the scores' decay, for the current capacity and rate."""
        self._capacity = max(1, self.capacity_pages // self.rate)
        self._keep = 1.0 - 1.0 / (self.HORIZON_TURNOVERS * self._capacity)

    def __len__(self) -> int:
        return len(self.rankings[0])

    @property
    def leader(self) -> EvictionPolicy:
        return self.rankings[self._leader]

    def learn_later(self, on: bool) -> None:
        if not on:
            self.catch_up()
        self.pending = [] if on else None

    def catch_up(self) -> None:
        pending = self.pending
        if pending:
            self.pending = []
            replay = self._replay
            for reference in pending:
                replay(*reference)

    def _reference(self, node: Node) -> None:
        key = node.key
        if not in_sample(key, self.rate):
            return
        parent = node.parent
        parent_key = None if parent is None else parent.key
        pending = self.pending
        if pending is None:
            self._replay(key, parent_key, node.tail, node.last_access, self.tick)
            return
        # What the shadows read of the node now: by `catch_up` it may have been touched again.
        pending.append((key, parent_key, node.tail, node.last_access, self.tick))
        if len(pending) >= self.MAX_PENDING:
            self.catch_up()

    def _replay(self, key: bytes, parent_key: bytes | None, tail: bool, last_access: int, tick: int) -> None:
        capacity, keep, scores = self._capacity, self._keep, self.scores
        i = 0
        for reference in self._references:
            scores[i] = (scores[i] + reference(key, parent_key, tail, last_access, tick, capacity)) * keep
            i += 1
        # The highest score leads, the first on a tie. Every score decays on every reference, and
        # two distinct scores can round to one, so the leader is found again each time.
        self._leader = scores.index(max(scores))

    def insert(self, node: Node) -> None:
        self.tick += 1
        for insert in self._inserts:
            insert(node)
        pages = len(self.rankings[0])
        if pages > self.capacity_pages:
            self.capacity_pages = pages
            self.rate = sample_rate(pages, self.SAMPLE)
            self._shadow_size()
        self._reference(node)

    def touch(self, node: Node) -> None:
        for touch in self._touches:
            touch(node)
        self._reference(node)

    def update(self, node: Node) -> None:
        for update in self._updates:
            update(node)

    def remove(self, node: Node) -> None:
        for remove in self._removes:
            remove(node)

    def victim(self) -> Node | None:
        return self.rankings[self._leader].victim()
