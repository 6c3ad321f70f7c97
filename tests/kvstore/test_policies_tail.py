"""`lru-tail`: tail pages (the partial ends of stored sequences) are evicted before the rest,
leaf-first, and what a user sees is more prefix hits where conversations continue, while a
sequence stored a moment ago is still served whole."""
from __future__ import annotations

from dataclasses import replace

import pytest

from bench.replay import compile_trace, replay
from bench.traces import PRESETS, Request, generate
from kvstore.index import Node
from kvstore.policies import POLICIES


def _trace(*prompts: list[int]):
    # Each prompt ends 100 tokens into its last 512-token block: that block is a tail page.
    return compile_trace("t", [Request(i, 512 * len(ids) - 100, 1, tuple(ids)) for i, ids in enumerate(prompts)])


def test_a_continued_conversation_outlives_request_ends() -> None:
    # 2 is extended by the second turn (4 hangs under it); 3, 4, 5, 6 are tails (prompt ends).
    # When 2 becomes a leaf, LRU drops it (oldest), lru-tail drops the newer tail 5 instead,
    # so the third turn [1, 2, 8] finds both of its leading blocks.
    trace = _trace([1, 2, 3], [1, 2, 4], [5], [6], [7], [1, 2, 8])
    tiers = [("cpu", 4)]
    assert replay(trace, tiers, "lru-tail").hit_blocks == replay(trace, tiers, "lru-prefix").hit_blocks + 1


def _leaf_first_checked(name: str) -> type:
    """Policy `name`, asserting at every eviction that the victim has no descendant in the tier
    and no pin."""

    class Checked(POLICIES[name]):  # type: ignore[misc, valid-type]
        def victim(self) -> Node | None:
            node = super().victim()
            assert node is None or (not node.tier_kids.get(self.tier, 0) and not node.pins), node
            return node

    return Checked


@pytest.mark.parametrize("policy", ["lru-tail", "duel", "duel-freq"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_leaf_first_and_no_worse_than_lru_on_generated_traces(preset: str, policy: str) -> None:
    trace = compile_trace(preset, generate(replace(PRESETS[preset], num_requests=600, seed=11)))
    for fraction in (0.02, 0.1):
        tiers = [("cpu", max(round(fraction * trace.unique_blocks), 200))]
        checked = replay(trace, tiers, _leaf_first_checked(policy)).hit_ratio
        assert checked == replay(trace, tiers, policy).hit_ratio
        assert checked >= replay(trace, tiers, "lru").hit_ratio - 0.002, (preset, fraction)


@pytest.mark.parametrize("policy", ["lru-tail", "duel", "duel-freq"])
def test_multi_tier_replay_keeps_every_tier_leaf_first(policy: str) -> None:
    trace = compile_trace("chat", generate(replace(PRESETS["chat"], num_requests=400, seed=5)))
    result = replay(trace, [("gpu", 150), ("cpu", 600)], _leaf_first_checked(policy))
    assert result.tier_hits["gpu"] > 0 and result.tier_hits["cpu"] > 0
