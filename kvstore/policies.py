"""Eviction policies: small strategy classes that pick a victim in one tier.

A policy instance belongs to one tier. The store (placement) tells it when a page enters the
tier (`insert`), is used (`touch`), leaves (`remove`), or may have changed eligibility
(`update`: unpinned, lost its last child in the tier); `victim()` returns the page to evict next,
which the caller then removes.

Each policy keeps a heap of (priority, seq, node) with lazy invalidation: a node's live entry is
the one whose seq matches `self._live[node]`; stale entries are skipped when popped. Ineligible
nodes (pinned, or not a leaf for leaf-first policies) are dropped from the heap when popped and
pushed back by `update`, so a victim search never loops over them twice. Seqs are unique within a
policy, so entries never tie: the order victims come out in depends only on which entries are in
the heap, never on the heap's layout, and compacting it (dropping stale entries) changes nothing.

A policy whose priority only grows while a page is used (leaf-first LRU: last use only moves
forward) sets `touch_in_place`: a touch leaves the page's entry as it is, ranked at an older
priority than its own. Such an entry can only surface early, never late, so `victim` re-ranks an
entry whose priority went stale when it surfaces and goes on; a surfaced entry whose priority is
current is a true minimum, since every other entry ranks its page at or below that page's
priority. (Pages of equal priority may come out in another order than eager pushes would give.)
A fetch touches every page it serves, in every tier's policy and shadow: the touch is the hot
call, and a dict lookup is what it costs now instead of a heap push.

The calls on the hot path (a store's insert and eviction, a fetch's touch and unpin, each in the
tier's rankings and both shadows of `duel`) inline their small helpers and call no method whose
answer is known (a touch that touches in place); their decisions are those of the plain methods
they inline, which stay for the subclasses that change a rule (bench/ research policies).

Policies never touch tiers or the tree; they only rank pages. This module imports no torch.
"""
from __future__ import annotations

import itertools
from collections import OrderedDict
from heapq import heapify, heappop, heappush
from typing import Any

from kvstore.index import Node
from kvstore.shadow import ShadowCache, sample_rate


class EvictionPolicy:
    """Base: LRU order over the pages of one tier. Subclasses override `priority`/`eligible`."""

    name = "base"
    leaf_first = False
    touch_in_place = False  # True only where `priority` never decreases over a page's life

    def __init__(self, tier: str):
        self.tier = tier
        self._heap: list[tuple[Any, int, Node]] = []
        self._live: dict[Node, int] = {}  # never rebound: `duel` holds its first ranking's
        self._seq = itertools.count()

    def priority(self, node: Node) -> Any:
        """Smaller is evicted first."""
        return node.last_access

    def eligible(self, node: Node) -> bool:
        if node.pins:
            return False
        # Leaf-first: never evict a page while a descendant is still cached in this tier, so no
        # tier ever holds a suffix whose prefix it dropped (orphans are unreachable by matching).
        return not (self.leaf_first and node.tier_kids.get(self.tier, 0))

    def _push(self, node: Node) -> None:
        seq = next(self._seq)
        live = self._live
        live[node] = seq
        heap = self._heap
        heappush(heap, (self.priority(node), seq, node))
        if len(heap) > 4 * len(live) + 64:
            self._compact()

    def _compact(self) -> None:
        # In place: `victim` holds the heap in a local while it pushes.
        live, heap = self._live, self._heap
        heap[:] = [e for e in heap if live.get(e[2]) == e[1]]
        heapify(heap)

    def insert(self, node: Node) -> None:
        self._push(node)

    def touch(self, node: Node) -> None:
        if node in self._live and not self.touch_in_place:
            self._push(node)

    def touches_nothing(self) -> bool:
        """True if `touch` never changes this policy (it touches in place, with the base
        `touch`): callers on the hot path skip the call."""
        return self.touch_in_place and type(self).touch is EvictionPolicy.touch

    def update(self, node: Node) -> None:
        # Only a parked node needs a new entry: an eligible one's priority has not changed (a
        # store unpins every page of its request, so re-pushing all of them was most of the work).
        if self._live.get(node) == -1:
            self._push(node)

    def remove(self, node: Node) -> None:
        self._live.pop(node, None)

    def learn_later(self, on: bool) -> None:
        """Policies that learn from the reference stream beside ranking pages (`duel`) may hold
        that work until `catch_up`; the ranking itself is always current. Others: nothing to do."""

    def catch_up(self) -> None:
        """Do the learning `learn_later` held back."""

    def __len__(self) -> int:
        return len(self._live)

    def victim(self) -> Node | None:
        heap, live = self._heap, self._live
        eligible, priority, in_place = self.eligible, self.priority, self.touch_in_place
        while heap:
            ranked, seq, node = heappop(heap)
            if live.get(node) != seq:
                continue  # stale entry
            if not eligible(node):
                live[node] = -1  # parked until `update` pushes it again
                continue
            if in_place and ranked != priority(node):
                self._push(node)  # touched since it was ranked: rank it where it belongs now
                continue
            # Every caller removes the victim from the tier next (placement evicts it, a shadow
            # drops it): ranking it again would cost a push now and a stale pop later. Parked,
            # so an `update` ranks it again should it stay.
            live[node] = -1
            return node
        return None


class LRUPolicy(EvictionPolicy):
    """Least recently used page first, whatever its place in the tree.

    Exact LRU down to the page: pages one request used tie on `last_access` and go in the order
    they were used, which only an eager touch keeps (the reference the eviction benchmark and its
    brute-force test compare against). Leaf-first policies touch in place: among one request's
    pages only the deepest can be a leaf, so their ties are not theirs to break."""

    name = "lru"


class LRUTailPolicy(EvictionPolicy):
    """Leaf-first LRU that evicts tail pages first: the partial last pages of stored sequences.

    A prompt's last page is usually partial, and the next turn of the conversation does not
    extend it: the store writes a *full* page with more tokens beside it (and drops the tail),
    so a tail page is matched again only by a retried prompt; in the Mooncake sample last blocks
    are reused far less often than the others (docs/eviction.md). So among evictable leaves, tail
    pages go first (LRU among them), then full pages in LRU order.

    Only real tails (fewer tokens than a full page, `Node.tail`) rank first: a full last page is
    what the next turn hangs its child under, and a sequence stored a moment ago is served whole.
    No constant; without tail pages this is plain leaf-first LRU (`lru-prefix` in bench/).

    Two heaps of (last access, seq, node) stand for the one of (priority, seq, node): `_tails`
    for tail pages, `_heap` for full ones, each entry in the heap of the `tail` its page had when
    it was pushed. Every tail entry ranks before every full one, so popping `_tails` until it is
    empty and then `_heap` pops the entries in the one heap's order, and an int compares for the
    pair (bool, int) on every step of a push or pop. An entry whose page's priority changed since
    (last access, or tail) is re-ranked when it surfaces, as `touch_in_place` says.
    A subclass that changes the ranking (priority, eligibility, leaf-first, touch in place) ranks
    in the base class's one heap, by the base class's methods (`_split` False).
    """

    name = "lru-tail"
    leaf_first = True
    touch_in_place = True
    _split = True  # the two heaps; False in a subclass that changes the ranking

    def __init__(self, tier: str):
        super().__init__(tier)
        self._tails: list[tuple[Any, int, Node]] = []  # tail pages' entries; `_heap`: full pages'

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        cls._split = (cls.priority is LRUTailPolicy.priority and cls.eligible is EvictionPolicy.eligible
                      and cls.leaf_first and cls.touch_in_place)

    def priority(self, node: Node) -> Any:
        return (not node.tail, node.last_access)

    def _push(self, node: Node) -> None:
        if not self._split:
            EvictionPolicy._push(self, node)
            return
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
        if not self._split:
            return EvictionPolicy.victim(self)
        tails, fulls, live, tier = self._tails, self._heap, self._live, self.tier
        while True:
            full = not tails
            heap = fulls if full else tails
            if not heap:
                return None
            ranked, seq, node = heappop(heap)
            if live.get(node) != seq:
                continue  # stale entry
            if node.pins or node.tier_kids.get(tier, 0):
                live[node] = -1  # parked (pinned, or not a leaf) until `update` pushes it again
                continue
            if ranked != node.last_access or (not node.tail) != full:
                self._push(node)  # touched since it was ranked: rank it where it belongs now
                continue
            live[node] = -1  # parked: the caller removes it next (see `EvictionPolicy.victim`)
            return node


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
        elif not segment.touch_in_place:  # in place: nothing to do
            segment.touch(node)

    def update(self, node: Node) -> None:
        segment = self._segment.get(node)
        if segment is not None:
            segment.update(node)

    def remove(self, node: Node) -> None:
        segment = self._segment.pop(node, None)  # `_leave`, inline: every eviction calls it
        if segment is not None:
            segment.remove(node)

    def _leave(self, node: Node) -> EvictionPolicy | None:
        """Take `node` out of its segment; -> the segment it was in (None: not held)."""
        segment = self._segment.pop(node, None)
        if segment is not None:
            segment.remove(node)
        return segment


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
        key, history, held = node.key, self.history, self._segment
        if key in history:
            history.move_to_end(key)
            segment = self.protected
        else:
            history[key] = None  # a new key goes in last
            segment = self.protected if node.hits else self.probation
        limit = self.HISTORY_TURNOVERS * (len(held) + 1)  # pages held, this one included
        while len(history) > limit:
            history.popitem(last=False)
        held[node] = segment  # `_admit`, inline
        segment.insert(node)

    def victim(self) -> Node | None:
        node = self.probation.victim()
        return node if node is not None else self.protected.victim()


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
        self._pair = tuple(self._references) if len(self._references) == 2 else None
        # The first ranking's pages, read without a call where it counts them in `_live`.
        first = self.rankings[0]
        self._first_live = first._live if type(first).__len__ is EvictionPolicy.__len__ else None
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
        if key[-1] % self.rate:  # in_sample, inline: this runs for every page a request uses
            return
        parent = node.parent
        parent_key = None if parent is None else parent.key
        pending = self.pending
        if pending is not None:
            # What the shadows read of the node now: by `catch_up` it may have been touched again.
            pending.append((key, parent_key, node.tail, node.last_access, self.tick))
            if len(pending) >= self.MAX_PENDING:
                self.catch_up()
            return
        if self._pair is None:
            self._replay(key, parent_key, node.tail, node.last_access, self.tick)
            return
        # `_replay` for two candidates, inline: the same references in the same order, the
        # same arithmetic.
        first, second = self._pair
        tail, last_access, tick, capacity, keep = node.tail, node.last_access, self.tick, self._capacity, self._keep
        scores = self.scores
        score0 = scores[0] = (scores[0] + first(key, parent_key, tail, last_access, tick, capacity)) * keep
        score1 = scores[1] = (scores[1] + second(key, parent_key, tail, last_access, tick, capacity)) * keep
        self._leader = 1 if score1 > score0 else 0

    def _replay(self, key: bytes, parent_key: bytes | None, tail: bool, last_access: int, tick: int) -> None:
        capacity, keep = self._capacity, self._keep
        scores = self.scores
        i = 0
        for reference in self._references:
            scores[i] = (scores[i] + reference(key, parent_key, tail, last_access, tick, capacity)) * keep
            i += 1
        # The highest score leads, the first on a tie. Every score decays on every reference, and
        # two distinct scores can round to one, so the leader is found again each time.
        best, top = 0, scores[0]
        for i in range(1, len(scores)):
            if scores[i] > top:
                best, top = i, scores[i]
        self._leader = best

    def insert(self, node: Node) -> None:
        self.tick += 1
        for insert in self._inserts:
            insert(node)
        held = self._first_live
        pages = len(self) if held is None else len(held)
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


# What `StoreConfig(policy=...)` offers: the default `duel`, the two rules it chooses between, and
# `lru` as the baseline. The research policies (leaf-first LRU, ARC, frequency-aware probation)
# live in bench/ and run through the eviction benchmark's replay (bench/policies_research.py).
POLICIES: dict[str, type[EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    LRUTailPolicy.name: LRUTailPolicy,
    SeenBeforePolicy.name: SeenBeforePolicy,
    DuelPolicy.name: DuelPolicy,
}
