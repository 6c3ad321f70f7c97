"""The policies' heap: a touch leaves a leaf-first LRU page's entry where it is (`touch_in_place`),
and the victim is still the page a full ranking would pick: the oldest eligible one."""
from __future__ import annotations

import random

import pytest

from bench.research.policies import BENCH_POLICIES
from kvstore.index import PageIndex
from kvstore.keys import page_key, tokens_bytes

NS = b"\x02" * 16


@pytest.mark.parametrize("name", ["lru-prefix", "lru-tail"])
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_victims_match_a_brute_force_ranking_under_random_touches_and_pins(name: str, seed: int) -> None:
    rng = random.Random(seed)
    policy = BENCH_POLICIES[name]("cpu")  # lru-prefix: the research baseline (bench/)
    assert policy.touch_in_place
    index = PageIndex()
    root = index.root(NS)
    held: list = []
    clock = 0
    for step in range(3000):
        clock += 1  # one use per step: no ties, so the order is the ranking's alone
        op = rng.random()
        if op < 0.35 or len(held) < 3:  # a new page under a random held page (or a root)
            parent = rng.choice(held) if held and rng.random() < 0.7 else root
            token = tokens_bytes([step])
            node = index.insert(parent, page_key(parent.key, token), token, tail=rng.random() < 0.2)
            node.last_access = clock
            node.tier_kids["cpu"] = 0
            if not parent.is_root:
                parent.tier_kids["cpu"] += 1
            held.append(node)
            policy.insert(node)
        elif op < 0.75:  # a use: the page's last access moves forward
            node = rng.choice(held)
            node.last_access = clock
            policy.touch(node)
        elif op < 0.85:  # a pin comes or goes
            node = rng.choice(held)
            node.pins = 1 - node.pins
            policy.update(node)
        else:  # evict: the policy's victim is the brute-force minimum over eligible pages
            eligible = [n for n in held if policy.eligible(n)]
            expected = min(eligible, key=policy.priority) if eligible else None
            victim = policy.victim()
            assert victim is expected, (step, victim, expected)
            if victim is None:
                continue
            policy.remove(victim)
            held.remove(victim)
            parent = victim.parent
            if not parent.is_root:
                parent.tier_kids["cpu"] -= 1
                if parent.tier_kids["cpu"] == 0:
                    policy.update(parent)
    assert len(policy) == len(held)
