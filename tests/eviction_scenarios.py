"""Eviction scenarios shared by the store's policy tests (tests/kvstore) and the research
policies' (tests/bench): a one-tier placement driven page by page, small block traces, and a
policy that checks leaf-first eviction as it runs. Policies are named as the replay names them
(a store policy, or a research one from bench/research/policies.py)."""
from __future__ import annotations

from dataclasses import replace

from bench.research.policies import BENCH_POLICIES, policy_factory
from bench.research.replay import CompiledTrace, ReplayResult, compile_trace, replay
from bench.research.traces import PRESETS, Request, generate
from kvstore.index import Node, PageIndex
from kvstore.keys import page_key, tokens_bytes
from kvstore.placement import Placement
from kvstore.policies import EvictionPolicy

NS = b"\x01" * 16
BLOCK_TOKENS = 512  # tokens per block of the traces below (bench.research.traces.BLOCK_TOKENS)


def block_trace(*prompts: list[int], tail_tokens: int = 0) -> CompiledTrace:
    """One request per prompt of block ids. With `tail_tokens`, each prompt ends that many tokens
    short of its last block, which the store keeps as a tail page; without, only recency and
    reuse decide."""
    return compile_trace("t", [Request(i, BLOCK_TOKENS * len(ids) - tail_tokens, 1, tuple(ids))
                               for i, ids in enumerate(prompts)])


class OneTier:
    """A one-tier placement driven page by page, as the store drives it."""

    def __init__(self, policy: str, capacity_pages: int):
        self.index = PageIndex()
        self.placement = Placement(self.index, [("cpu", capacity_pages)], policy_factory(policy))
        self.root = self.index.root(NS)
        self.clock = 0

    def store(self, *ids: int) -> list[Node]:
        """Store a chain of pages (touch those held, add the rest), pinned while it is stored."""
        self.clock += 1
        parent, held = self.root, []
        for i in ids:
            token = tokens_bytes([i])
            node = self.index.get(page_key(parent.key, token))
            if node is None:
                if not self.placement.make_room("cpu", 1):
                    break
                node = self.index.insert(parent, page_key(parent.key, token), token)
                node.ready = True
                self.placement.pin(node)
                self.placement.touch(node, self.clock)
                self.placement.add(node, "cpu", 1)
            else:
                self.placement.pin(node)
                self.placement.touch(node, self.clock)
            held.append(node)
            parent = node
        for node in held:
            self.placement.unpin(node)
        return held

    def holds(self, *ids: int) -> bool:
        key = NS
        for i in ids:
            key = page_key(key, tokens_bytes([i]))
        node = self.index.get(key)
        return node is not None and "cpu" in node.tiers


def keeps_a_key_stored_again_soon_after_eviction(policy: str) -> bool:
    """Page 1 leaves a 3-page tier, is stored again while its key may be remembered, then three
    pages never seen before arrive (5 and 6 are older than 7): is page 1 still held?"""
    tier = OneTier(policy, 3)
    for i in (1, 2, 3, 4):
        tier.store(i)
    assert not tier.holds(1)
    tier.store(1)
    for i in (5, 6, 7):
        tier.store(i)
    assert tier.holds(7)
    return tier.holds(1)


def hits_on_a_prompt_recurring_between_one_off_prompts(*policies: str) -> list[int]:
    """Hit blocks of each policy where prompt [1, 2] recurs after every 3 one-off single-block
    prompts, in 4 pages of room (all keys go through a duel's shadows: far too small to sample)."""
    prompts: list[list[int]] = [[1, 2], [1, 2]]
    fresh = 100
    for _ in range(60):
        prompts += [[fresh], [fresh + 1], [fresh + 2], [1, 2]]
        fresh += 3
    trace = block_trace(*prompts)
    return [replay(trace, [("cpu", 4)], policy).hit_blocks for policy in policies]


def leaf_first_checked(name: str) -> type[EvictionPolicy]:
    """Policy `name`, asserting at every eviction that the victim has no descendant in the tier
    and no pin."""

    class Checked(BENCH_POLICIES[name]):  # type: ignore[misc, valid-type]
        def victim(self) -> Node | None:
            node = super().victim()
            assert node is None or (not node.tier_kids.get(self.tier, 0) and not node.pins), node
            return node

    return Checked


def assert_leaf_first_and_no_worse_than_lru(policy: str, preset: str) -> None:
    """On a 400-request `preset` trace at 2% and 10% of its blocks, `policy` checked leaf-first at
    every eviction hits as it does unchecked, and never below LRU by more than 0.002."""
    trace = compile_trace(preset, generate(replace(PRESETS[preset], num_requests=400, seed=11)))
    for fraction in (0.02, 0.1):
        tiers = [("cpu", max(round(fraction * trace.unique_blocks), 200))]
        checked = replay(trace, tiers, leaf_first_checked(policy)).hit_ratio
        assert checked == replay(trace, tiers, policy).hit_ratio
        assert checked >= replay(trace, tiers, "lru").hit_ratio - 0.002, (preset, fraction)


def two_tier_replay_checked_leaf_first(policy: str) -> ReplayResult:
    """A 400-request chat trace through gpu (150 pages) over cpu (600), `policy` checked
    leaf-first in each tier."""
    trace = compile_trace("chat", generate(replace(PRESETS["chat"], num_requests=400, seed=5)))
    return replay(trace, [("gpu", 150), ("cpu", 600)], leaf_first_checked(policy))
