"""The research policies live in bench/research/, not in the store: the replay runs them by name beside
the store's own, and they keep the guarantees every policy gives
(a sequence just stored is served whole; ARC's ghosts remember evicted keys)."""
from __future__ import annotations

from dataclasses import replace

import pytest

from eviction_scenarios import block_trace, keeps_a_key_stored_again_soon_after_eviction

from bench.eviction import main
from bench.research.policies import BENCH_POLICIES, RESEARCH_POLICIES
from bench.research.replay import Replayer
from bench.research.traces import PRESETS, generate, save_trace
from kvstore.index import Node
from kvstore.policies import POLICIES, LRUTailPolicy


def test_the_replay_knows_the_store_policies_and_the_research_ones() -> None:
    # StoreConfig refusing the research names: tests/kvstore/test_config_keys.py.
    assert set(RESEARCH_POLICIES) == {"lru-prefix", "arc-prefix", "arc-tail", "seen-often", "seen-learned",
                                      "duel-freq"}
    assert list(BENCH_POLICIES) == [*POLICIES, *RESEARCH_POLICIES]


@pytest.mark.parametrize("policy", sorted(RESEARCH_POLICIES))
def test_a_sequence_just_stored_is_served_whole_under_pressure(policy: str) -> None:
    # As the store's own policies do (tests/kvstore/test_store.py): 30 prompts of 4 full pages
    # through 10 pages of room, each fetched again right after it is stored.
    prompts = [[i * 100 + t for t in range(4)] for i in range(30)]
    trace = block_trace(*[p for prompt in prompts for p in (prompt, prompt)])
    replayer = Replayer([("cpu", 10)], policy)
    for r in range(trace.requests):
        served = replayer.request(trace.keys[r], trace.tokens[r], trace.next_use[r])
        assert len(served) == (4 if r % 2 else 0), (policy, r)


def test_arc_tail_remembers_a_key_evicted_a_moment_ago() -> None:
    # Its ghost list: page 1 leaves, comes back while its key is remembered, and is then kept
    # over pages never seen before (as seen-before's history keeps it).
    assert keeps_a_key_stored_again_soon_after_eviction("arc-tail")


def test_the_eviction_cli_runs_research_policies_and_refuses_unknown_names(tmp_path, capsys) -> None:
    path = tmp_path / "t.jsonl"
    save_trace(path, generate(replace(PRESETS["chat"], num_requests=200)))
    main([str(path), "--capacities", "0.05", "--policies", "lru,arc-tail,duel-freq"])
    out = capsys.readouterr().out
    assert "| capacity | lru | arc-tail | duel-freq |" in out
    with pytest.raises(SystemExit):
        main([str(path), "--policies", "lru,fifo"])
    assert "unknown 'fifo'" in capsys.readouterr().err


def test_a_policy_that_changes_lru_tails_ranking_is_refused_at_definition() -> None:
    # lru-tail's two heaps rank by (tail, last access) only: a subclass that ranks otherwise
    # would be ranked wrong without a word, so defining one fails and names the way out.
    with pytest.raises(TypeError, match="changes priority.*derive from EvictionPolicy"):
        class Shifted(LRUTailPolicy):
            def priority(self, node: Node) -> tuple:
                return (not node.tail, -node.last_access)
