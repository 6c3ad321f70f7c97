"""Which insert-time features of a page predict that it is reused before LRU would evict it?

Replays a trace through the store's index and placement with `lru-tail` (leaf-first LRU), and
for every page the tier takes in records what a policy could know when the page is stored, then
whether a fetch served it before it left the tier (`reused`: the label a policy at that size
must predict) and whether any later request uses it at all (`ever`: the oracle's label).

Features (all computable by a policy from the `Node` and its own bookkeeping):
- `depth`: the page's depth in its sequence (0 = first page);
- `run`: pages between it and the hit boundary of the request that stored it (0 = the first
  new page after the prefix the request found cached, or the first page of a request that
  found nothing);
- `anchor_hits`: times the page at the hit boundary had been served (`-` if the request found
  nothing: the new run hangs under the root);
- `hit_len`: length of the prefix the storing request found cached (pages);
- `siblings`: other children its parent already had when it was stored (a branching point);
- `tail`: a partial last page;
- `seen`: its key was stored into the tier within the last 10 x capacity stores (seen-before);
- `count`: times its key was stored into the tier before (all history);
- `last_gap`: stores since its key was last stored, in turnovers (capacities); `never` if new;
- `req_len`, `to_end`: the storing request's length and the pages after this one in it (a policy
  learns them when the request is done, not at insert);
- `gap_ms`: the request's inter-arrival time (a policy does not see it; for comparison).

With `--belady` the label is the offline optimum's (was the page served before Belady evicted
it), to see which pages the optimum invests in. With `--optgen` it is what a Hawkeye predictor
trains on (Jain & Lin, ISCA 2016): would MIN at the tier's size, over the stream of references
the tier sees, keep the page from this store to its next use (`bench.belady.OptGen`; a reuse
more than 8 turnovers later counts as not kept); the replay itself is `lru-tail`'s.

    python bench/reuse_features.py bench/data/mooncake_synthetic.jsonl --capacities 0.02,0.05
    python bench/reuse_features.py --preset chat --seed 0
    python bench/reuse_features.py bench/data/mooncake_synthetic.jsonl --belady
    python bench/reuse_features.py bench/data/mooncake_synthetic.jsonl --optgen

It prints, per feature and bucket, the share of inserted pages, the reuse rate under LRU and
the ever-reused rate, and the weighted entropy drop each feature gives on the `reused` label.
"""
from __future__ import annotations

import argparse
import math
import sys
from collections import OrderedDict, defaultdict
from dataclasses import replace
from pathlib import Path

from typing import Any

if __package__ in (None, ""):  # run as a script
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from kvstore.index import Node
from kvstore.policies import EvictionPolicy, LRUTailPolicy

from bench.research.belady import BeladyPolicy, OptGen
from bench.research.replay import NEVER, NextUse, compile_trace, replay
from bench.research.traces import PRESETS, Request, generate, load_trace

FEATURES = ("depth", "run", "anchor_hits", "hit_len", "siblings", "tail", "seen", "count", "last_gap",
            "req_len", "to_end", "gap_ms")


def bucket(n: int) -> str:
    """0, 1, 2-3, 4-7, ... (powers of two)."""
    if n <= 1:
        return str(n)
    lo = 1 << (n.bit_length() - 1)
    return f"{lo}-{2 * lo - 1}"


class Recorder(EvictionPolicy):
    """`lru-tail`'s order (or, with `belady`, the offline optimum's) that records each page's
    features at insert and its outcome at removal (with `optgen`: MIN's decision, once its next
    use comes). It ranks in the base class's one heap: Belady's priority is not a last access."""

    leaf_first = True
    touch_in_place = True

    def __init__(self, tier: str, oracle: NextUse, gaps: list[float], req_lens: list[int], capacity: int,
                 rows: list, belady: bool = False, optgen: bool = False):
        super().__init__(tier)
        self.belady = BeladyPolicy(tier, oracle) if belady else None
        # Every reference (a store, or the first touch of a held page in a request) goes through
        # OPTgen; stores carry their features as the tag, and get their row when MIN decides.
        self.optgen = OptGen(self._min_decided) if optgen else None
        self.referenced: dict[Node, int] = {}  # node -> store number at its last reference
        self.oracle, self.gaps, self.capacity, self.rows = oracle, gaps, capacity, rows
        self.req_lens = req_lens  # a policy learns a request's length only when it is done
        self.feat: dict[Node, dict] = {}
        self.history: OrderedDict[bytes, None] = OrderedDict()
        self.stores = 0
        self.last_store: dict[bytes, int] = {}  # key -> store number of its last insert (unbounded)
        self.count: dict[bytes, int] = defaultdict(int)  # key -> inserts so far (unbounded)

    def insert(self, node: Node) -> None:
        super().insert(node)
        parent = node.parent
        pf = self.feat.get(parent) if parent is not None else None
        # Parent stored by this same request: the store clock is the same.
        if pf is not None and pf["_clock"] == node.last_access:
            run, anchor_hits, hit_len = pf["_run"] + 1, pf["anchor_hits"], pf["_hit_len"]
        elif parent is None or parent.is_root:
            run, anchor_hits, hit_len = 0, "-", 0
        else:
            run, anchor_hits, hit_len = 0, bucket(parent.hits), parent.depth
        seen = node.key in self.history
        self.history[node.key] = None
        self.history.move_to_end(node.key)
        while len(self.history) > 10 * self.capacity:
            self.history.popitem(last=False)
        self.stores += 1
        last = self.last_store.get(node.key)
        self.last_store[node.key] = self.stores
        count = self.count[node.key]
        self.count[node.key] += 1
        if last is None:
            last_gap = "never"
        else:
            ratio = (self.stores - last) / self.capacity
            last_gap = next(f"<{b}" for b in (1, 2, 4, 10, 100, float("inf")) if ratio < b)
        request = node.last_access // 2 - 1  # the replayer's clock: fetch 2r+1, store 2r+2
        gap = self.gaps[request] if 0 <= request < len(self.gaps) else 0.0
        self.feat[node] = {
            "_clock": node.last_access, "_run": run, "_hit_len": hit_len,
            "_ever": self.oracle.of.get(node.key, NEVER) != NEVER,
            "depth": bucket(node.depth - 1), "run": bucket(run), "anchor_hits": anchor_hits,
            "hit_len": bucket(hit_len), "siblings": bucket(len(parent.children) - 1) if parent else "0",
            "tail": node.tail, "seen": seen, "count": bucket(count), "last_gap": last_gap,
            "req_len": bucket(self.req_lens[request]),
            "to_end": bucket(self.req_lens[request] - node.depth), "gap_ms": bucket(int(gap)),
        }
        if self.optgen is not None:
            self.referenced[node] = self.stores
            self.optgen.reference(node.key, self.feat[node], self.capacity)

    def _min_decided(self, features: dict | None, kept: bool) -> None:
        if features is not None:  # a store's reference (touches carry no features)
            self.rows.append((features, kept))

    def touch(self, node: Node) -> None:
        # A request's fetch and store touch a held page twice, with no store between: one reference.
        if self.optgen is not None and node in self._live and self.referenced.get(node) != self.stores:
            self.referenced[node] = self.stores
            self.optgen.reference(node.key, None, self.capacity)
        super().touch(node)

    def priority(self, node: Node) -> Any:
        return self.belady.priority(node) if self.belady is not None else LRUTailPolicy.priority(self, node)

    def remove(self, node: Node) -> None:
        super().remove(node)
        self.referenced.pop(node, None)
        f = self.feat.pop(node, None)
        if f is not None and self.optgen is None:
            self.rows.append((f, node.hits > 0))


def entropy(p: float) -> float:
    return 0.0 if p <= 0.0 or p >= 1.0 else -(p * math.log2(p) + (1 - p) * math.log2(1 - p))


def report(name: str, rows: list) -> None:
    n = len(rows)
    base = sum(r for _, r in rows) / n
    ever = sum(f["_ever"] for f, _ in rows) / n
    print(f"\n{name}: {n} pages labelled, reused {base:.3f}, ever reused {ever:.3f}")
    gains = []
    for feature in FEATURES:
        by: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
        for f, r in rows:
            c = by[str(f[feature])]
            c[0] += 1
            c[1] += r
            c[2] += f["_ever"]
        cond = sum(c[0] / n * entropy(c[1] / c[0]) for c in by.values())
        gains.append((entropy(base) - cond, feature))
        cells = "  ".join(f"{k}:{c[0] / n:.2f}/{c[1] / c[0]:.2f}/{c[2] / c[0]:.2f}"
                          for k, c in sorted(by.items(), key=lambda kv: (len(kv[0]), kv[0])))
        print(f"  {feature:>11} (share/reused/ever)  {cells}")
    print("  information gain on `reused` (bits; base entropy %.3f): " % entropy(base)
          + ", ".join(f"{f} {g:.3f}" for g, f in sorted(gains, reverse=True)))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("trace", nargs="?", help="Mooncake-format JSONL (or --preset)")
    parser.add_argument("--preset", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--capacities", default="0.02,0.05")
    label = parser.add_mutually_exclusive_group()
    label.add_argument("--belady", action="store_true", help="label by the offline optimum's hits, not lru's")
    label.add_argument("--optgen", action="store_true", help="label by MIN's decision at the tier's size (OPTgen)")
    args = parser.parse_args(argv)
    if args.preset:
        requests: list[Request] = generate(replace(PRESETS[args.preset], seed=args.seed))
        name = f"{args.preset} seed {args.seed}"
    else:
        requests, name = load_trace(args.trace), Path(args.trace).name
    trace = compile_trace(name, requests)
    gaps = [0.0] + [b.timestamp - a.timestamp for a, b in zip(requests, requests[1:])]
    req_lens = [len(r.hash_ids) for r in requests]
    for fraction in (float(c) for c in args.capacities.split(",")):
        capacity = max(1, round(fraction * trace.unique_blocks))
        rows: list = []
        oracle = NextUse()
        replay(trace, [("cpu", capacity)], lambda tier: Recorder(tier, oracle, gaps, req_lens, capacity, rows,
                                                                      args.belady, args.optgen), oracle)
        labelled = "belady" if args.belady else "lru-tail, labelled by OPTgen" if args.optgen else "lru-tail"
        report(f"{name} at {fraction:.0%} ({capacity} pages), {labelled}", rows)


if __name__ == "__main__":
    main()
