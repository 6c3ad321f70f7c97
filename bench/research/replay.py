"""Payload-free replay of a block trace through the store's real index, placement and policies.

Each hash id becomes one page of one "token" (page_size 1, the token being the id), keyed with
the store's own chained `page_key`, and every page takes 1 unit in every tier, so capacities are
in blocks. A request is replayed the way an engine drives `KVStore`:

1. fetch: match the leading run of its blocks (the hit); pin and touch them, count each in the
   tier that serves it (the top tier that holds it), promote lower-tier hits to the top tier;
2. store: touch the blocks already held and insert the others into the top tier that can make
   room, everything pinned until the request is done (as `KVStore.store` does).

It does not copy bytes (NullMover), model time, or run concurrent requests.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field

from kvstore.index import Node, PageIndex
from kvstore.keys import page_key, tokens_bytes
from kvstore.placement import Placement, PolicyFactory

from bench.research.policies import policy_factory
from bench.research.traces import BLOCK_TOKENS, Request

NAMESPACE = b"\x00" * 16  # the one namespace of a replay
NEVER = 1 << 62  # next use of a block that is not used again


@dataclass
class CompiledTrace:
    """A trace turned into page keys once, shared by every policy and capacity replayed."""

    name: str
    keys: list[list[bytes]]  # per request: chained page keys of its blocks
    tokens: list[list[bytes]]  # per request: each block's one token (int32 LE), the hash id
    next_use: list[list[int]]  # per request and block: index of the next request using it, or NEVER
    input_lengths: list[int]  # tokens per prompt
    total_blocks: int
    unique_blocks: int

    @property
    def requests(self) -> int:
        return len(self.keys)


def compile_trace(name: str, requests: list[Request]) -> CompiledTrace:
    """Keys and next uses of every block. Raises ValueError if ids are not prefix-chained
    (one id seen after two different predecessors), since the hit definition relies on it."""
    key_of: dict[int, bytes] = {}
    token_of: dict[int, bytes] = {}
    parent_of: dict[int, int | None] = {}
    keys, tokens = [], []
    for r, req in enumerate(requests):
        parent: int | None = None
        parent_key = NAMESPACE
        for h in req.hash_ids:
            if h not in key_of:
                parent_of[h] = parent
                token_of[h] = tokens_bytes([h])
                key_of[h] = page_key(parent_key, token_of[h])
            elif parent_of[h] != parent:
                raise ValueError(f"request {r}: hash id {h} follows {parent}, earlier {parent_of[h]}: "
                                 "the trace is not prefix-chained")
            parent, parent_key = h, key_of[h]
        keys.append([key_of[h] for h in req.hash_ids])
        tokens.append([token_of[h] for h in req.hash_ids])
    next_use: list[list[int]] = [[] for _ in requests]
    seen: dict[int, int] = {}
    for r in range(len(requests) - 1, -1, -1):
        ids = requests[r].hash_ids
        next_use[r] = [seen.get(h, NEVER) for h in ids]
        for h in ids:
            seen[h] = r
    return CompiledTrace(name, keys, tokens, next_use, [req.input_length for req in requests],
                         sum(len(k) for k in keys), len(key_of))


class NextUse:
    """The offline oracle: the next request that uses each page, as of the request being
    replayed. Only Belady reads it; the replayer updates it before it touches a request's pages."""

    def __init__(self) -> None:
        self.of: dict[bytes, int] = {}


@dataclass
class ReplayResult:
    hit_blocks: int = 0
    total_blocks: int = 0
    tier_hits: dict[str, int] = field(default_factory=dict)
    prefill_tokens_saved: int = 0
    seconds: float = 0.0

    @property
    def hit_ratio(self) -> float:
        return self.hit_blocks / self.total_blocks if self.total_blocks else 0.0


class Replayer:
    """One policy over one tier configuration (name, capacity in blocks; top first)."""

    def __init__(self, tiers: list[tuple[str, int]], policy: str | PolicyFactory,
                 oracle: NextUse | None = None, promote_on_hit: bool = True):
        """`policy`: a store policy's name, a research policy's (bench/policies_research.py), or
        a factory of one policy per tier."""
        self.index = PageIndex()
        self.placement = Placement(self.index, tiers, policy_factory(policy))
        self.root = self.index.root(NAMESPACE)
        self.top = self.placement.order[0]
        self.oracle = oracle or NextUse()
        self.promote_on_hit = promote_on_hit
        self.clock = 0

    def request(self, keys: list[bytes], tokens: list[bytes], next_use: list[int],
                last_is_tail: bool = False) -> list[str]:
        """Replay one request; returns the tier that served each hit block, in order.
        `last_is_tail`: the prompt ends inside its last block, which the store keeps as a tail
        page (fewer tokens than a full page), as KVStore does."""
        placement, index = self.placement, self.index
        self.oracle.of.update(zip(keys, next_use))
        # -- fetch: the leading run of cached blocks is the hit.
        path: list[Node] = []
        for key in keys:
            node = index.get(key)
            if node is None or not node.ready:
                break
            path.append(node)
        served: list[str] = []
        self.clock += 1
        for node in path:
            placement.pin(node)
            placement.touch(node, self.clock)
            node.hits += 1
            served.append(next(t for t in placement.order if t in node.tiers))
        if self.promote_on_hit:
            for node, tier in zip(path, served):
                if tier != self.top and self.top not in node.tiers and placement.make_room(self.top, 1):
                    placement.add(node, self.top, 1)
                    placement.usage[self.top].promotions += 1
        for node in path:
            placement.unpin(node)
        # -- store: touch what is held, insert the rest under it.
        self.clock += 1
        held: list[Node] = []
        parent = self.root
        for i, (key, token) in enumerate(zip(keys, tokens)):
            node = index.get(key)
            if node is None:
                tier = next((t for t in placement.order if placement.make_room(t, 1)), None)
                if tier is None:
                    break  # every page is pinned: store what fitted, as KVStore.store does
                node = index.insert(parent, key, token, tail=last_is_tail and i == len(keys) - 1)
                node.ready = True
                placement.pin(node)
                placement.touch(node, self.clock)
                placement.add(node, tier, 1)
            else:
                placement.pin(node)
                placement.touch(node, self.clock)
            held.append(node)
            parent = node
        for node in held:
            placement.unpin(node)
        return served


def replay(trace: CompiledTrace, tiers: list[tuple[str, int]], policy: str | PolicyFactory,
           oracle: NextUse | None = None, progress: "object | None" = None) -> ReplayResult:
    """Replay the whole trace; `progress` (a tqdm bar) is advanced by requests."""
    replayer = Replayer(tiers, policy, oracle)
    result = ReplayResult(tier_hits={name: 0 for name, _ in tiers})
    start = time.perf_counter()
    for r in range(trace.requests):
        keys = trace.keys[r]
        served = replayer.request(keys, trace.tokens[r], trace.next_use[r],
                                  last_is_tail=trace.input_lengths[r] % BLOCK_TOKENS != 0)
        for tier in served:
            result.tier_hits[tier] += 1
        result.hit_blocks += len(served)
        result.total_blocks += len(keys)
        result.prefill_tokens_saved += min(len(served) * BLOCK_TOKENS, trace.input_lengths[r])
        if progress is not None and r % 256 == 255:
            progress.update(256)  # type: ignore[attr-defined]
    if progress is not None:
        progress.update(trace.requests % 256)  # type: ignore[attr-defined]
    result.seconds = time.perf_counter() - start
    return result
