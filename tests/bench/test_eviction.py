"""The eviction benchmark: replay correctness against a brute-force LRU, Belady as an upper line,
and the CLI's JSON output."""
from __future__ import annotations

import json
from dataclasses import replace

import pytest

from bench.research.belady import BeladyPolicy
from bench.eviction import main
from bench.research.replay import NextUse, compile_trace, replay
from bench.research.traces import PRESETS, generate, save_trace


def brute_force_lru(requests: list[tuple[int, ...]], capacity: int) -> int:
    """Hit blocks of the store's `lru`: evict the least recently stored block (ties: earlier in
    its request) that the current request does not hold yet, and with it every cached block
    chained below it (the index drops a page's subtree with its last copy)."""
    cache: dict[int, tuple[int, int]] = {}  # block -> (last request, position there)
    parent: dict[int, int | None] = {}
    hits = 0
    for r, ids in enumerate(requests):
        k = 0
        while k < len(ids) and ids[k] in cache:
            k += 1
        hits += k
        for i, h in enumerate(ids):
            if h not in cache:
                while len(cache) >= capacity:
                    victim = min((b for b in cache if b not in ids[:i]), key=cache.__getitem__)
                    for b in list(cache):
                        a: int | None = b
                        while a is not None and a != victim:
                            a = parent[a]
                        if a == victim:
                            del cache[b]
            parent[h] = ids[i - 1] if i else None
            cache[h] = (r, i)
    return hits


SMALL = {name: replace(spec, num_requests=400, num_prefixes=min(spec.num_prefixes, 40))
         for name, spec in PRESETS.items()}


@pytest.mark.parametrize("capacity", [40, 120, 400])
def test_lru_replay_matches_brute_force(capacity: int) -> None:
    requests = generate(replace(SMALL["chat"], seed=3, unique_blocks_mean=6))
    trace = compile_trace("small", requests)
    capacity = max(capacity, max(len(r.hash_ids) for r in requests) + 1)  # no request is pinned out
    result = replay(trace, [("cpu", capacity)], "lru")
    assert result.hit_blocks == brute_force_lru([r.hash_ids for r in requests], capacity)


@pytest.mark.parametrize("preset", sorted(SMALL))
def test_belady_is_at_least_lru_and_lru_prefix(preset: str) -> None:
    trace = compile_trace(preset, generate(replace(SMALL[preset], seed=7, num_requests=250)))
    for fraction in (0.02, 0.2):  # the scarce end and the roomy end
        tiers = [("cpu", max(round(fraction * trace.unique_blocks), 400))]
        oracle = NextUse()
        best = replay(trace, tiers, lambda tier: BeladyPolicy(tier, oracle), oracle).hit_ratio
        for policy in ("lru", "lru-prefix", "arc-prefix", "lru-tail", "arc-tail", "seen-before", "duel",
                       "seen-often", "seen-learned", "duel-freq"):
            assert best >= replay(trace, tiers, policy).hit_ratio, (preset, fraction, policy)


def test_cli_writes_json_and_multi_tier_hits(tmp_path) -> None:
    path = tmp_path / "t.jsonl"
    save_trace(path, generate(SMALL["chat"]))
    out = tmp_path / "r.json"
    main([str(path), "--tiers", "gpu=0.02,cpu=0.1", "--policies", "lru,belady", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["requests"] == 400 and report["unique_blocks"] > 0
    for row in report["results"]:
        assert set(row) >= {"policy", "capacity_fraction", "capacity_blocks", "hit_ratio", "tier_hits",
                            "prefill_tokens_saved"}
        assert sum(row["tier_hits"].values()) > 0 and row["tier_hits"]["cpu"] > 0


def _min_with_bypass(keys: list[bytes], capacity: int) -> int:
    """Hits of Belady's MIN when a missed key may be dropped at once: keep the `capacity` keys
    whose next use is soonest (the one just referenced included)."""
    next_use, seen = [0] * len(keys), {}
    for i in range(len(keys) - 1, -1, -1):
        next_use[i] = seen.get(keys[i], len(keys))
        seen[keys[i]] = i
    cache: dict[bytes, int] = {}
    hits = 0
    for i, key in enumerate(keys):
        hits += key in cache
        cache[key] = next_use[i]
        if len(cache) > capacity:
            del cache[max(cache, key=cache.__getitem__)]
    return hits


def test_optgen_reconstructs_belady_with_bypass(monkeypatch) -> None:
    # Over a window long enough to hold every reuse, OPTgen's online decisions are MIN's.
    import random

    import bench.research.belady as belady

    monkeypatch.setattr(belady, "WINDOW_TURNOVERS", 10**6)
    for trial in range(200):
        rng = random.Random(trial)
        keys = [bytes([rng.randrange(rng.randint(2, 12))]) for _ in range(rng.randint(5, 60))]
        capacity = rng.randint(1, 5)
        outcomes: list[bool] = []
        optgen = belady.OptGen(lambda tag, hit: outcomes.append(hit))
        for key in keys:
            optgen.reference(key, None, capacity)
        assert sum(outcomes) == _min_with_bypass(keys, capacity), (trial, capacity)


def test_optgen_tags_outcomes_and_forgets_past_its_window() -> None:
    from bench.research.belady import WINDOW_TURNOVERS, OptGen

    outcomes: list[tuple[str, bool]] = []
    optgen = OptGen(lambda tag, hit: outcomes.append((tag, hit)))
    for key, tag in ((b"a", "a1"), (b"b", "b1"), (b"a", "a2")):  # capacity 1: a's reuse fits
        optgen.reference(key, tag, 1)
    assert outcomes == [("a1", True)]
    for i in range(WINDOW_TURNOVERS + 1):  # a is not referenced again within 8 steps: MIN dropped it
        optgen.reference(bytes([100 + i]), None, 1)
    assert ("a2", False) in outcomes and ("b1", False) in outcomes


def test_reuse_features_optgen_label_is_reuse_when_everything_fits() -> None:
    # With room for every block nothing is evicted and MIN keeps every page until its next use:
    # each stored page whose key is used again gets one row, labelled kept, and no other does.
    from bench.research.reuse_features import Recorder

    requests = generate(replace(SMALL["chat"], seed=5))
    trace = compile_trace("chat", requests)
    capacity = trace.unique_blocks
    rows: list = []
    made: list[Recorder] = []
    oracle = NextUse()

    def make(tier: str) -> Recorder:
        made.append(Recorder(tier, oracle, [0.0] * len(requests), [len(r.hash_ids) for r in requests],
                             capacity, rows, optgen=True))
        return made[0]

    replay(trace, [("cpu", capacity)], make, oracle)
    stored = list(made[0].feat.values())  # every page stored, none evicted
    assert len(stored) == trace.unique_blocks
    assert len(rows) == sum(f["_ever"] for f in stored) > 100
    assert all(kept and features["_ever"] for features, kept in rows)
