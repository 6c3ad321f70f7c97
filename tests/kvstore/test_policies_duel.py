"""`duel`: the default policy follows whichever of `lru-tail` and `seen-before` its shadow caches
say hits more on the tier's own traffic; what a user sees is LRU-like hits where fresh pages are
reused once, protection of what comes back where a prompt recurs, leaf-first eviction and pins
respected. Also `seen-before`'s memory of evicted keys and the shadows' key samples."""
from __future__ import annotations

from dataclasses import replace

import pytest

from eviction_scenarios import OneTier, block_trace, hits_on_a_prompt_recurring_between_one_off_prompts, \
    keeps_a_key_stored_again_soon_after_eviction

from bench.research.policy_arc import LRUPrefixPolicy
from bench.research.replay import Replayer, compile_trace, replay
from bench.research.traces import PRESETS, generate
from kvstore.config import StoreConfig
from kvstore.index import Node
from kvstore.keys import page_key, tokens_bytes
from kvstore.policies import POLICIES, DuelPolicy
from kvstore.shadow import MIN_SAMPLED_PAGES, ShadowCache, in_sample, sample_rate


def test_registered_and_the_default() -> None:
    assert POLICIES["duel"] is DuelPolicy
    assert StoreConfig().policy == "duel"


def test_evicts_the_least_recent_leaf_never_a_page_with_a_descendant() -> None:
    tier = OneTier("duel", 3)
    tier.store(1, 2)  # 1 -> 2: page 1 has a descendant in the tier
    tier.store(7)
    tier.store(8)  # full: the oldest leaf goes (2), not its parent 1, though 1 is as old
    assert tier.holds(1) and not tier.holds(1, 2) and tier.holds(7) and tier.holds(8)
    tier.store(9)  # now 1 is a leaf and the least recently used
    assert not tier.holds(1) and tier.holds(7) and tier.holds(8) and tier.holds(9)


def test_pinned_pages_are_never_evicted() -> None:
    tier = OneTier("duel", 2)
    (old,) = tier.store(1)
    tier.store(2)
    tier.placement.pin(old)  # a fetch is streaming it
    tier.store(3)
    assert tier.holds(1) and not tier.holds(2) and tier.holds(3)
    (page3,) = tier.store(3)
    tier.placement.pin(page3)
    assert tier.store(4) == []  # every page pinned: nothing is evicted, nothing stored
    assert tier.holds(1) and tier.holds(3)


@pytest.mark.parametrize("policy", ["seen-before", "lru-tail"])
def test_a_key_stored_again_soon_after_eviction_is_protected(policy: str) -> None:
    # seen-before's history: page 1 leaves, comes back while its key is remembered, and is then
    # kept over pages that were never seen before (5 and 6 go first though 1 is older); LRU drops it.
    assert keeps_a_key_stored_again_soon_after_eviction(policy) == (policy != "lru-tail")


def test_follows_the_rule_that_keeps_a_prompt_recurring_between_one_off_prompts() -> None:
    # lru-tail drops block 2 each time (its oldest leaf); seen-before keeps the recurring prompt,
    # and the duel, whose shadows see that, ends up with nearly its hits.
    lru, kept, dueled = hits_on_a_prompt_recurring_between_one_off_prompts("lru-tail", "seen-before", "duel")
    assert kept > lru
    assert dueled > lru + (kept - lru) // 2


def test_follows_lru_where_fresh_pages_are_reused_once() -> None:
    # Chat-like: each conversation's first turn [c, c+1] is reused once by its second turn two
    # requests later; an early served prompt [1] is never used again. LRU keeps the fresh pages;
    # seen-before evicts them first (they are new keys) and the duel must not follow it.
    prompts: list[list[int]] = [[1], [1]]
    for c in range(100, 400, 10):
        prompts += [[c, c + 1], [c + 5], [c, c + 1, c + 2]]
    trace = block_trace(*prompts)
    tiers = [("cpu", 4)]
    lru, seen, duel = (replay(trace, tiers, p).hit_blocks for p in ("lru-tail", "seen-before", "duel"))
    assert seen < lru <= duel


@pytest.mark.parametrize("preset", ["chat", "high"])
def test_a_shadow_cache_hits_what_the_tier_hits(preset: str) -> None:
    # The shadow of a leaf-first LRU (bench's lru-prefix), fed the tier's references, counts
    # exactly the hits the real tier (index, placement, pins) serves: the duel compares like with like.
    trace = compile_trace(preset, generate(replace(PRESETS[preset], num_requests=400, seed=3)))
    capacity = max(round(0.05 * trace.unique_blocks), 200)
    shadow_hits = []

    class Tapped(LRUPrefixPolicy):
        def __init__(self, tier: str):
            super().__init__(tier)
            self.shadow, self.tick, self.hits = ShadowCache(tier, LRUPrefixPolicy), 0, 0
            shadow_hits.append(self)

        def insert(self, node: Node) -> None:
            self.tick += 1
            super().insert(node)
            self._reference(node)

        def touch(self, node: Node) -> None:
            super().touch(node)
            self._reference(node)

        def _reference(self, node: Node) -> None:
            parent_key = node.parent.key if node.parent is not None else None
            self.hits += self.shadow.reference(node.key, parent_key, node.tail, node.last_access, self.tick, capacity)

    result = replay(trace, [("cpu", capacity)], Tapped)
    assert result.hit_blocks > 0
    assert shadow_hits[0].hits == result.hit_blocks
    assert len(shadow_hits[0].shadow) <= capacity


@pytest.mark.parametrize("preset", ["chat", "high", "docs"])
def test_learning_after_each_request_serves_what_learning_inline_does(preset: str) -> None:
    # The sidecar holds duel's shadow work until its answer is out and catches up after each
    # request (`learn_later`). The rankings stay current, only the leader lags by one request:
    # the hits are those of learning inline, within 0.5%.
    trace = compile_trace(preset, generate(replace(PRESETS[preset], num_requests=600, seed=3)))
    capacity = max(round(0.05 * trace.unique_blocks), 150)
    hits = []
    for later in (False, True):
        replayer = Replayer([("cpu", capacity)], "duel")
        policy = replayer.placement.policies["cpu"]
        replayer.placement.learn_later(later)
        served = held = 0
        for r in range(trace.requests):
            served += len(replayer.request(trace.keys[r], trace.tokens[r], trace.next_use[r]))
            if later:
                held += len(policy.pending)
                replayer.placement.catch_up()
                assert policy.pending == []
        assert (held > 0) == later  # learning later did hold the shadows' work
        hits.append(served)
    inline, later_hits = hits
    assert inline > 0 and abs(later_hits - inline) <= 0.005 * inline


def test_held_learning_is_replayed_inline_past_its_bound() -> None:
    # An in-process caller that sets learn_later and never catches up holds at most MAX_PENDING.
    tier = OneTier("duel", 8)
    policy = tier.placement.policies["cpu"]
    tier.placement.learn_later(True)
    for i in range(3 * DuelPolicy.MAX_PENDING // 2):
        tier.store(i)
    assert 0 < len(policy.pending) < DuelPolicy.MAX_PENDING
    assert sum(len(shadow) for shadow in policy.shadows) > 0  # the first MAX_PENDING were replayed
    tier.placement.learn_later(False)  # turning it off catches up
    assert policy.pending is None


def test_shadow_samples_are_uniform_nested_and_never_small() -> None:
    keys = [page_key(b"\x02" * 16, tokens_bytes([i])) for i in range(8192)]
    quarter = {k for k in keys if in_sample(k, 4)}
    eighth = {k for k in keys if in_sample(k, 8)}
    assert eighth <= quarter and abs(len(eighth) / len(keys) - 1 / 8) < 0.02
    assert sample_rate(MIN_SAMPLED_PAGES * 2 - 1, 8) == 1  # a smaller shadow would not be trusted
    assert sample_rate(MIN_SAMPLED_PAGES * 2, 8) == 2
    assert sample_rate(MIN_SAMPLED_PAGES * 100, 8) == 8
