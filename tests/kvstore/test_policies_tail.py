"""`lru-tail`: tail pages (the partial ends of stored sequences) are evicted before the rest,
leaf-first, and what a user sees is more prefix hits where conversations continue, while a
sequence stored a moment ago is still served whole."""
from __future__ import annotations

import pytest

from eviction_scenarios import assert_leaf_first_and_no_worse_than_lru, block_trace, \
    two_tier_replay_checked_leaf_first

from bench.research.replay import replay
from bench.research.traces import PRESETS


def test_a_continued_conversation_outlives_request_ends() -> None:
    # Each prompt ends 100 tokens into its last 512-token block: that block is a tail page.
    # 2 is extended by the second turn (4 hangs under it); 3, 4, 5, 6 are tails (prompt ends).
    # When 2 becomes a leaf, LRU drops it (oldest), lru-tail drops the newer tail 5 instead,
    # so the third turn [1, 2, 8] finds both of its leading blocks.
    trace = block_trace([1, 2, 3], [1, 2, 4], [5], [6], [7], [1, 2, 8], tail_tokens=100)
    tiers = [("cpu", 4)]
    assert replay(trace, tiers, "lru-tail").hit_blocks == replay(trace, tiers, "lru-prefix").hit_blocks + 1


@pytest.mark.parametrize("policy", ["lru-tail", "duel"])
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_leaf_first_and_no_worse_than_lru_on_generated_traces(preset: str, policy: str) -> None:
    assert_leaf_first_and_no_worse_than_lru(policy, preset)


@pytest.mark.parametrize("policy", ["lru-tail", "duel"])
def test_multi_tier_replay_keeps_every_tier_leaf_first(policy: str) -> None:
    result = two_tier_replay_checked_leaf_first(policy)
    assert result.tier_hits["gpu"] > 0 and result.tier_hits["cpu"] > 0
