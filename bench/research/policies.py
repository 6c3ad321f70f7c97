"""The research policies the eviction benchmark can replay beside the store's own.

`StoreConfig(policy=...)` offers what a user should pick (kvstore/policies.py `POLICIES`: the
default `duel`, the `lru-tail` and `seen-before` rules it chooses between, and `lru` as the
baseline). The policies studied on the way there live here, in bench/, and the replay
(bench/replay.py) resolves their names through `BENCH_POLICIES`, so `bench/eviction.py
--policies arc-tail,duel-freq` still runs them through the store's real index and placement.
docs/eviction.md has what each measured.
"""
from __future__ import annotations

from kvstore.placement import PolicyFactory
from kvstore.policies import POLICIES, EvictionPolicy

from bench.research.policy_arc import ARCPrefixPolicy, ARCTailPolicy, LRUPrefixPolicy
from bench.research.policy_frequency import FrequencyDuelPolicy, SeenLearnedPolicy, SeenOftenPolicy

RESEARCH_POLICIES: dict[str, type[EvictionPolicy]] = {
    LRUPrefixPolicy.name: LRUPrefixPolicy,
    ARCPrefixPolicy.name: ARCPrefixPolicy,
    ARCTailPolicy.name: ARCTailPolicy,
    SeenOftenPolicy.name: SeenOftenPolicy,
    SeenLearnedPolicy.name: SeenLearnedPolicy,
    FrequencyDuelPolicy.name: FrequencyDuelPolicy,
}

# Every name the benchmark replays: the store's policies first, in their order, then the research ones.
BENCH_POLICIES: dict[str, type[EvictionPolicy]] = {**POLICIES, **RESEARCH_POLICIES}


def policy_factory(policy: str | PolicyFactory) -> str | PolicyFactory:
    """What `Placement` takes for `policy`: a store policy's name as it is (the store's own
    lookup), a research policy's name as its class, a factory as it is. ValueError: unknown name."""
    if not isinstance(policy, str) or policy in POLICIES:
        return policy
    if policy in RESEARCH_POLICIES:
        return RESEARCH_POLICIES[policy]
    raise ValueError(f"policy: unknown {policy!r}; choose from {', '.join(BENCH_POLICIES)}")
