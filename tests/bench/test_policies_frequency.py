"""`duel-freq` and its frequency-aware candidates `seen-often` and
`seen-learned`: what a user sees is a page needed often kept over a newer page needed once,
hit ratios at least LRU's on generated traces, and the structures' bounds holding throughout."""
from __future__ import annotations

from dataclasses import replace

import pytest

from eviction_scenarios import assert_leaf_first_and_no_worse_than_lru, block_trace, \
    hits_on_a_prompt_recurring_between_one_off_prompts, leaf_first_checked, two_tier_replay_checked_leaf_first

from bench.research.policies import RESEARCH_POLICIES
from bench.research.policy_frequency import SAMPLE, FrequencyDuelPolicy, SeenLearnedPolicy, SeenOftenPolicy
from bench.research.replay import compile_trace, replay
from bench.research.traces import PRESETS, generate
from kvstore.index import Node
from kvstore.shadow import MIN_SAMPLED_PAGES


def test_registered_with_the_replay() -> None:
    assert RESEARCH_POLICIES["duel-freq"] is FrequencyDuelPolicy
    assert RESEARCH_POLICIES["seen-often"] is SeenOftenPolicy and RESEARCH_POLICIES["seen-learned"] is SeenLearnedPolicy


def test_a_page_served_often_outlives_a_newer_page_served_once() -> None:
    # 4 pages. [1] is served 4 times, [2] once, later; then a 3-page prompt needs room while its
    # own pages are pinned, so a protected page must go: seen-before takes the least recent ([1]),
    # seen-often the one needed less often ([2]), and the next request for [1] hits.
    trace = block_trace([1], [1], [1], [1], [1], [2], [2], [9], [10, 11, 12], [1])
    tiers = [("cpu", 4)]
    often, before = (replay(trace, tiers, p).hit_blocks for p in ("seen-often", "seen-before"))
    assert often == before + 1


def _checked(name: str) -> type:
    """Policy `name`, asserting its structure's invariants every 61st call and at every eviction
    that the victim is an unpinned leaf of the tier."""

    class Checked(leaf_first_checked(name)):  # type: ignore[misc, valid-type]
        calls = 0

        def _check(self) -> None:
            Checked.calls += 1
            if Checked.calls % 61:
                return
            rankings = getattr(self, "rankings", [self])
            held = set(rankings[0]._segment) if hasattr(rankings[0], "_segment") else set(rankings[0]._live)
            for ranking in rankings:
                if isinstance(ranking, SeenOftenPolicy):
                    assert set(ranking._segment) == held
                    assert set(ranking.stamp) == set(ranking.shift) == set(ranking.stores) == held
                    assert len(ranking.history) <= ranking.HISTORY_TURNOVERS * max(1, len(held) + 1)
                if isinstance(ranking, SeenLearnedPolicy):
                    assert len(ranking.shadow) <= max(1, ranking.capacity_pages // ranking.rate)
                    assert ranking.rate <= SAMPLE
            for shadow in getattr(self, "shadows", []):
                assert len(shadow) <= max(1, self.capacity_pages // self.rate)

        def insert(self, node: Node) -> None:
            super().insert(node)
            self._check()

        def remove(self, node: Node) -> None:
            super().remove(node)
            self._check()

    return Checked


@pytest.mark.parametrize("policy", ["seen-often", "seen-learned", "duel-freq"])
@pytest.mark.parametrize("preset", ["chat", "high"])
def test_invariants_hold_through_a_replay(preset: str, policy: str) -> None:
    trace = compile_trace(preset, generate(replace(PRESETS[preset], num_requests=500, seed=13)))
    tiers = [("cpu", max(round(0.05 * trace.unique_blocks), 300))]
    checked = replay(trace, tiers, _checked(policy))
    assert checked.hit_ratio == replay(trace, tiers, policy).hit_ratio > 0


@pytest.mark.slow  # a research policy's long replays: pytest -m slow tests/bench
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_duel_freq_at_least_lru_on_generated_traces_with_sampled_shadows(preset: str) -> None:
    # Tiers of 4096+ pages: the shadows see 1/4 to 1/8 of the keys, enough for the duel to follow
    # the candidate that hits more, and it never ends below lru.
    trace = compile_trace(preset, generate(replace(PRESETS[preset], num_requests=2000, seed=17)))
    for fraction in (0.05, 0.2):
        tiers = [("cpu", max(round(fraction * trace.unique_blocks), 4 * MIN_SAMPLED_PAGES))]
        ours, lru = (replay(trace, tiers, p).hit_ratio for p in ("duel-freq", "lru"))
        assert ours >= lru - 0.002, (preset, fraction, ours, lru)


def test_follows_the_rule_that_keeps_a_prompt_recurring_between_one_off_prompts() -> None:
    # As `duel` follows seen-before there (tests/kvstore/test_policies_duel.py), `duel-freq`
    # follows seen-often, which keeps the recurring prompt by frequency.
    lru, kept, dueled = hits_on_a_prompt_recurring_between_one_off_prompts("lru-tail", "seen-often", "duel-freq")
    assert kept > lru
    assert dueled > lru + (kept - lru) // 2


@pytest.mark.slow  # a research policy's long replays: pytest -m slow tests/bench
@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_duel_freq_is_leaf_first_and_no_worse_than_lru_on_generated_traces(preset: str) -> None:
    assert_leaf_first_and_no_worse_than_lru("duel-freq", preset)


def test_duel_freq_multi_tier_replay_keeps_every_tier_leaf_first() -> None:
    result = two_tier_replay_checked_leaf_first("duel-freq")
    assert result.tier_hits["gpu"] > 0 and result.tier_hits["cpu"] > 0
