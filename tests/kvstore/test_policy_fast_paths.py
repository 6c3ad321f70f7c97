"""The policies' fast paths decide exactly as their plain ones: `lru-tail`'s two heaps as the base
class's one heap of (priority, seq) entries, `duel`'s inline replay of its two shadows as the loop
over any number, a shadow that skips a touch changing nothing as one that makes it. A user sees
the same pages evicted in the same order, and the same leader, for every reference stream:
random seeded streams of the calls placement makes (stores of new and returning keys, touches,
pins, removals, evictions, learning held and caught up), ties and uses out of order included."""
from __future__ import annotations

import hashlib
import random
from typing import Any

import pytest

import kvstore.shadow
from kvstore.index import Node
from kvstore.policies import DuelPolicy, EvictionPolicy, LRUTailPolicy, SeenBeforePolicy

TIER = "cpu"
CAPACITY_PAGES = 48  # the tier the streams store into
NS = b"\x03" * 16


class OneHeapTail(LRUTailPolicy):
    """lru-tail through the base class's methods: its ranking restated, so `_split` is off, and
    a touch that is made (it changes nothing) rather than skipped."""

    def priority(self, node: Node) -> Any:
        return (not node.tail, node.last_access)

    def touch(self, node: Node) -> None:
        super().touch(node)


class OneHeapSeenBefore(SeenBeforePolicy):
    segment_policy = OneHeapTail


class PlainDuel(DuelPolicy):
    """duel over the plain candidates, replaying its shadows through the loop over candidates."""

    candidates = (OneHeapTail, OneHeapSeenBefore)

    def __init__(self, tier: str):
        super().__init__(tier)
        self._pair = None


def drive(make_policy: type[EvictionPolicy], seed: int, steps: int = 3000) -> list[tuple]:
    """A seeded random stream of placement's calls into one policy: every victim's key in order
    (None: nothing evictable), with duel's leader, scores and sample rate after it, then the
    order the pages left would go in."""
    rng = random.Random(seed)
    policy = make_policy(TIER)
    duel = isinstance(policy, DuelPolicy)
    root = Node(NS, None, b"", NS)
    held: list[Node] = []
    gone: list[bytes] = []  # keys evicted, which a later store may bring back
    clock = serial = 0
    decisions: list[tuple] = []

    def remove(node: Node) -> None:
        held.remove(node)
        gone.append(node.key)
        del node.tiers[TIER]
        policy.remove(node)
        parent = node.parent
        if parent is not root:
            parent.tier_kids[TIER] -= 1
            if parent.tier_kids[TIER] == 0:
                policy.update(parent)  # it may have become an evictable leaf

    def decided(node: Node | None) -> None:
        state = (policy._leader, tuple(policy.scores), policy.rate) if duel else ()
        decisions.append((None if node is None else node.key, *state))

    for step in range(steps):
        returning = 0.7 if step // 500 % 2 else 0.05  # phases where keys come back, and where few do
        op = rng.random()
        clock += rng.random() < 0.7  # pages of one request share a clock value: ties
        if op < 0.45 or not held:  # a store: a new key, or one evicted before, into a full tier
            while len(held) >= CAPACITY_PAGES:
                node = policy.victim()
                decided(node)
                if node is None:
                    break  # all pinned or parents: the page is not stored
                remove(node)
            if len(held) >= CAPACITY_PAGES:
                continue
            parent = root if not held or rng.random() < 0.3 else rng.choice(held)
            if parent.tail:
                parent = root  # a tail page is always a leaf
            held_keys = {n.key for n in held}
            back = [k for k in gone[-4 * CAPACITY_PAGES:] if k not in held_keys]
            if back and rng.random() < returning:
                key = rng.choice(back)
            else:
                serial += 1
                key = hashlib.blake2b(serial.to_bytes(8, "little") + bytes([seed]), digest_size=16).digest()
            node = Node(key, parent, b"t", NS)
            node.tail = rng.random() < 0.2
            node.last_access = clock
            node.hits = int(rng.random() < 0.1)
            node.tiers[TIER] = 1
            if parent is not root:
                parent.tier_kids[TIER] = parent.tier_kids.get(TIER, 0) + 1
            held.append(node)
            policy.insert(node)
        elif op < 0.6:  # a use; now and then one whose clock is behind the page's last
            node = rng.choice(held)
            node.last_access = clock - (rng.random() < 0.1) * rng.randrange(1, 4)
            node.hits += rng.random() < 0.3
            policy.touch(node)
        elif op < 0.8:  # a pin comes or goes
            node = rng.choice(held)
            node.pins = node.pins - 1 if node.pins and rng.random() < 0.7 else node.pins + 1
            policy.update(node)
        elif op < 0.9:
            node = policy.victim()
            decided(node)
            if node is not None:
                assert node in held and not node.pins and not node.tier_kids.get(TIER, 0)
                remove(node)
        elif op < 0.93:
            leaves = [n for n in held if not n.tier_kids.get(TIER, 0)]
            if leaves:
                remove(rng.choice(leaves))  # a copy lost on its own
        elif op < 0.935:  # not a thing the store does (a page's tail is set once), ranked alike all the same
            leaves = [n for n in held if not n.tier_kids.get(TIER, 0)]
            if leaves:
                node = rng.choice(leaves)
                node.tail = not node.tail
        elif op < 0.985:
            policy.learn_later(rng.random() < 0.5)
        else:
            policy.catch_up()
    policy.catch_up()
    assert len(policy) == len(held)
    for node in held:
        node.pins = 0
        policy.update(node)
    while held:
        node = policy.victim()
        decided(node)
        assert node is not None
        remove(node)
    return decisions


@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fast, plain", [(LRUTailPolicy, OneHeapTail), (SeenBeforePolicy, OneHeapSeenBefore),
                                         (DuelPolicy, PlainDuel)], ids=["lru-tail", "seen-before", "duel"])
def test_fast_paths_evict_what_the_plain_ones_do(fast: type[EvictionPolicy], plain: type[EvictionPolicy],
                                                 seed: int) -> None:
    assert LRUTailPolicy._split and not OneHeapTail._split
    decisions = drive(fast, seed)
    assert decisions == drive(plain, seed)
    victims = [d[0] for d in decisions]
    assert len(set(victims)) > 300  # many pages evicted, some of them more than once (keys come back)
    assert len(victims) - victims.count(None) > len(set(victims))
    if fast is DuelPolicy:
        assert {d[1] for d in decisions} == {0, 1}  # both candidates led at some point


def test_sampled_shadows_decide_as_the_plain_ones(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(kvstore.shadow, "MIN_SAMPLED_PAGES", 16)  # sample a small tier's keys
    decisions = drive(DuelPolicy, 7, steps=4000)
    assert decisions == drive(PlainDuel, 7, steps=4000)
    assert max(d[3] for d in decisions) > 1  # the shadows did sample
