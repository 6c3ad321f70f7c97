"""`duel-freq` and its frequency-aware candidates `seen-often` and
`seen-learned`: what a user sees is a page needed often kept over a newer page needed once,
hit ratios at least LRU's on generated traces, and the structures' bounds holding throughout."""
from __future__ import annotations

from dataclasses import replace

import pytest

from bench.replay import compile_trace, replay
from bench.traces import PRESETS, Request, generate
from kvstore.config import StoreConfig
from kvstore.index import Node
from kvstore.keys import page_key, tokens_bytes
from kvstore.policies import POLICIES, FrequencyDuelPolicy, SeenLearnedPolicy, SeenOftenPolicy
from kvstore.policy_frequency import SAMPLE
from kvstore.shadow import MIN_SAMPLED_PAGES, in_sample, sample_rate


def _trace(*prompts: list[int]):
    # Whole 512-token blocks: no tail pages, so only recency and frequency decide.
    return compile_trace("t", [Request(i, 512 * len(ids), 1, tuple(ids)) for i, ids in enumerate(prompts)])


def test_registered() -> None:
    assert POLICIES["duel-freq"] is FrequencyDuelPolicy
    assert POLICIES["seen-often"] is SeenOftenPolicy and POLICIES["seen-learned"] is SeenLearnedPolicy
    assert StoreConfig(policy="duel-freq").policy == "duel-freq"


def test_a_page_served_often_outlives_a_newer_page_served_once() -> None:
    # 4 pages. [1] is served 4 times, [2] once, later; then a 3-page prompt needs room while its
    # own pages are pinned, so a protected page must go: seen-before takes the least recent ([1]),
    # seen-often the one needed less often ([2]), and the next request for [1] hits.
    trace = _trace([1], [1], [1], [1], [1], [2], [2], [9], [10, 11, 12], [1])
    tiers = [("cpu", 4)]
    often, before = (replay(trace, tiers, p).hit_blocks for p in ("seen-often", "seen-before"))
    assert often == before + 1


def _checked(name: str) -> type:
    """Policy `name`, asserting its structure's invariants every 61st call and at every eviction
    that the victim is an unpinned leaf of the tier."""

    class Checked(POLICIES[name]):  # type: ignore[misc, valid-type]
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

        def victim(self) -> Node | None:
            node = super().victim()
            assert node is None or (not node.tier_kids.get(self.tier, 0) and not node.pins), node
            return node

    return Checked


@pytest.mark.parametrize("policy", ["seen-often", "seen-learned", "duel-freq"])
@pytest.mark.parametrize("preset", ["chat", "high"])
def test_invariants_hold_through_a_replay(preset: str, policy: str) -> None:
    trace = compile_trace(preset, generate(replace(PRESETS[preset], num_requests=500, seed=13)))
    tiers = [("cpu", max(round(0.05 * trace.unique_blocks), 300))]
    checked = replay(trace, tiers, _checked(policy))
    assert checked.hit_ratio == replay(trace, tiers, policy).hit_ratio > 0


def test_shadow_samples_are_uniform_nested_and_never_small() -> None:
    keys = [page_key(b"\x02" * 16, tokens_bytes([i])) for i in range(8192)]
    quarter = {k for k in keys if in_sample(k, 4)}
    eighth = {k for k in keys if in_sample(k, 8)}
    assert eighth <= quarter and abs(len(eighth) / len(keys) - 1 / 8) < 0.02
    assert sample_rate(MIN_SAMPLED_PAGES * 2 - 1, 8) == 1  # a smaller shadow would not be trusted
    assert sample_rate(MIN_SAMPLED_PAGES * 2, 8) == 2
    assert sample_rate(MIN_SAMPLED_PAGES * 100, 8) == 8


@pytest.mark.parametrize("preset", sorted(PRESETS))
def test_duel_freq_at_least_lru_on_generated_traces_with_sampled_shadows(preset: str) -> None:
    # Tiers of 4096+ pages: the shadows see 1/4 to 1/8 of the keys, enough for the duel to follow
    # the candidate that hits more, and it never ends below lru.
    trace = compile_trace(preset, generate(replace(PRESETS[preset], num_requests=2000, seed=17)))
    for fraction in (0.05, 0.2):
        tiers = [("cpu", max(round(fraction * trace.unique_blocks), 4 * MIN_SAMPLED_PAGES))]
        ours, lru = (replay(trace, tiers, p).hit_ratio for p in ("duel-freq", "lru"))
        assert ours >= lru - 0.002, (preset, fraction, ours, lru)
