"""Mooncake-format request traces: load, save, and generate synthetic ones.

A trace is JSONL, one request a line: `timestamp` (ms), `input_length` and `output_length`
(tokens) and `hash_ids`, one id per 512-token block of the prompt, prefix-chained: two requests
share block i's id only if they share every block up to and including i (Mooncake's format).

The generator exists so that eviction policies are judged on more than the one sample trace
(docs/design.md §8): its knobs set how much of the traffic is shared prefixes (system prompts, tool and
document templates, by Zipf popularity) and how much is multi-turn sessions whose next turn
extends the last one. It does not model token contents, only block identity.

Run `python bench/traces.py OUT.jsonl --preset chat` to write one.
"""
from __future__ import annotations

import argparse
import json
import random
from dataclasses import dataclass, replace
from pathlib import Path

BLOCK_TOKENS = 512  # tokens per hash id in the Mooncake format


@dataclass(frozen=True)
class Request:
    timestamp: int  # ms
    input_length: int  # tokens
    output_length: int  # tokens
    hash_ids: tuple[int, ...]  # one per BLOCK_TOKENS of the prompt, prefix-chained


def load_trace(path: str | Path) -> list[Request]:
    requests = []
    with open(path) as f:
        for line in f:
            if line.strip():
                r = json.loads(line)
                requests.append(Request(int(r["timestamp"]), int(r["input_length"]),
                                        int(r.get("output_length", 0)), tuple(r["hash_ids"])))
    return requests


def save_trace(path: str | Path, requests: list[Request]) -> None:
    with open(path, "w") as f:
        for r in requests:
            f.write(json.dumps({"timestamp": r.timestamp, "input_length": r.input_length,
                                "output_length": r.output_length, "hash_ids": list(r.hash_ids)}) + "\n")


@dataclass(frozen=True)
class TraceSpec:
    """Knobs of a synthetic trace. Means are of geometric distributions (heavy enough tails)."""

    num_requests: int = 5000
    num_prefixes: int = 200  # distinct shared prefixes (system prompts, templates)
    prefix_zipf: float = 1.0  # popularity skew of the prefixes; 0 = uniform
    prefix_blocks_mean: float = 8.0  # length of a shared prefix, blocks
    unique_blocks_mean: float = 12.0  # a new session's own content after its prefix, blocks
    followup_prob: float = 0.4  # a request continues an open session (next turn) instead of opening one
    turn_blocks_mean: float = 3.0  # blocks a follow-up turn adds (answer + new question)
    open_sessions: int = 64  # sessions that can still get a next turn; the oldest is closed past this
    end_prob: float = 0.25  # a session ends after a turn with this probability
    mean_gap_ms: float = 200.0  # mean inter-arrival time (Poisson arrivals)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.num_prefixes < 1 or self.open_sessions < 1:
            raise ValueError("num_requests, num_prefixes and open_sessions: expected >= 1")
        for name in ("followup_prob", "end_prob"):
            if not 0.0 <= getattr(self, name) <= 1.0:
                raise ValueError(f"{name}: expected a probability in [0, 1], got {getattr(self, name)}")
        for name in ("prefix_blocks_mean", "unique_blocks_mean", "turn_blocks_mean"):
            if getattr(self, name) < 1.0:
                raise ValueError(f"{name}: expected >= 1 block, got {getattr(self, name)}")


# Named points of the sharing space: the tests and the README's validation use all of them.
PRESETS: dict[str, TraceSpec] = {
    # Many rarely-shared prefixes, mostly one-shot requests: little to reuse.
    "low": TraceSpec(num_prefixes=2000, prefix_zipf=0.6, prefix_blocks_mean=4, unique_blocks_mean=20,
                     followup_prob=0.15),
    # Chat: a few hundred system prompts, half the traffic is next turns.
    "chat": TraceSpec(),
    # Agents / few-shot: a handful of long popular prefixes, long sessions.
    "high": TraceSpec(num_prefixes=30, prefix_zipf=1.2, prefix_blocks_mean=24, unique_blocks_mean=6,
                      followup_prob=0.6, end_prob=0.1),
    # Long documents read once each, shared templates in front: one-time blocks dominate.
    "docs": TraceSpec(num_prefixes=50, prefix_zipf=0.9, prefix_blocks_mean=6, unique_blocks_mean=40,
                      followup_prob=0.3, turn_blocks_mean=2, end_prob=0.5),
}


def _geometric(rng: random.Random, mean: float) -> int:
    """>= 1, with the given mean."""
    p = 1.0 / mean
    n = 1
    while rng.random() > p:
        n += 1
    return n


def generate(spec: TraceSpec) -> list[Request]:
    """A trace with `spec.num_requests` requests; ids are prefix-chained by construction
    (a block's id is new unless the whole chain up to it is reused)."""
    rng = random.Random(spec.seed)
    next_id = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_id
        ids = list(range(next_id, next_id + n))
        next_id += n
        return ids

    prefixes = [fresh(_geometric(rng, spec.prefix_blocks_mean)) for _ in range(spec.num_prefixes)]
    weights = [1.0 / (rank + 1) ** spec.prefix_zipf for rank in range(spec.num_prefixes)]
    sessions: list[list[int]] = []  # open sessions: the last prompt's hash ids
    out: list[Request] = []
    now = 0.0
    for _ in range(spec.num_requests):
        now += rng.expovariate(1.0 / spec.mean_gap_ms)
        if sessions and rng.random() < spec.followup_prob:
            i = rng.randrange(len(sessions))
            # The last block of a prompt is partial: the next turn's block there is a new one.
            ids = sessions[i][:-1] + fresh(_geometric(rng, spec.turn_blocks_mean) + 1)
            if rng.random() < spec.end_prob:
                sessions.pop(i)
            else:
                sessions[i] = ids
        else:
            prefix = rng.choices(prefixes, weights)[0]
            ids = prefix + fresh(_geometric(rng, spec.unique_blocks_mean))
            sessions.append(ids)
            if len(sessions) > spec.open_sessions:
                sessions.pop(0)
        tokens = (len(ids) - 1) * BLOCK_TOKENS + rng.randint(1, BLOCK_TOKENS)
        out.append(Request(int(now), tokens, _geometric(rng, 200), tuple(ids)))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", help="JSONL file to write")
    parser.add_argument("--preset", choices=sorted(PRESETS), default="chat")
    parser.add_argument("--requests", type=int, default=None, help="override the preset's num_requests")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    spec = replace(PRESETS[args.preset], seed=args.seed)
    if args.requests is not None:
        spec = replace(spec, num_requests=args.requests)
    requests = generate(spec)
    save_trace(args.out, requests)
    blocks = sum(len(r.hash_ids) for r in requests)
    unique = len({h for r in requests for h in r.hash_ids})
    print(f"{args.out}: {len(requests)} requests, {blocks} blocks, {unique} unique")


if __name__ == "__main__":
    main()
