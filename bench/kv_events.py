"""KV events: exactness under churn (a subscriber's picture and predicted lookups against the
store's, in memory or with `--zmq` through the publisher), and what events cost a one-page store
and fetch (off and on in alternating blocks).

    python bench/kv_events.py [--ops 100000] [--checkpoint-every 1000] [--seed 0] [--zmq] [--json FILE]

docs/kv_events.md, "Measured".
"""
from __future__ import annotations

import random
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: an older kvstore there wins

import torch  # noqa: E402

from kvstore import KVStore, ModelSpec, StoreConfig  # noqa: E402
from kvstore.keys import page_key, tokens_bytes  # noqa: E402
from kvstore.kv_events.log import KVEventLog  # noqa: E402
from tests.kv_event_view import KVEventView  # noqa: E402
from kvstore.kv_events.wire import TIER_MEDIA, block_hash  # noqa: E402
from bench.report import parser as bench_parser, write_json  # noqa: E402
from bench.timing import settle_collector  # noqa: E402

SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=16, dtype="float32", page_size=4)
MODELS = (("m", None), ("m", "acme"), ("other", None))  # (name, tenant): three namespaces


@dataclass
class Checkpoint:
    ops: int
    pages: int  # pages the store holds, summed over tiers
    missing: int  # pages the store holds that the subscriber does not
    phantom: int  # pages the subscriber holds that the store does not
    lookups: int
    lookup_mismatches: int


@dataclass
class Exactness:
    checkpoints: list[Checkpoint] = field(default_factory=list)
    ops: dict[str, int] = field(default_factory=dict)
    events: int = 0
    moves: dict[str, int] = field(default_factory=dict)  # evictions / demotions / promotions, per tier, all runs

    @property
    def exact(self) -> bool:
        return all(c.missing == 0 and c.phantom == 0 and c.lookup_mismatches == 0 for c in self.checkpoints)


def store_picture(store: KVStore) -> dict[tuple[str, str], set[int]]:
    """What the store holds, per (medium, locality): every ready page of every tier, by block hash."""
    held: dict[tuple[str, str], set[bytes]] = {}
    with store._lock:
        for node in store._index.nodes.values():
            if node.ready:
                for tier in node.tiers:
                    held.setdefault(TIER_MEDIA[tier], set()).add(block_hash(node.key))
    return held


def predicted_match(view: KVEventView, namespace: bytes, extra: tuple, tokens: list[int], page_size: int) -> int:
    """The tokens a lookup matches, from the subscriber's picture alone: whole pages by their
    chained key, then the longest run shared with a held child (the store's token-granular match)."""
    held = set().union(*view.held.values()) if view.held else set()
    parent: int | None = None
    parent_key = namespace
    matched = 0
    while len(tokens) - matched >= page_size:
        page = tokens[matched:matched + page_size]
        parent_key = page_key(parent_key, tokens_bytes(page))
        key = block_hash(parent_key)
        if key not in held or view.tokens.get(key) != page:
            break
        parent = key
        matched += page_size
    rest = tokens[matched:matched + page_size]
    best = 0
    if rest:
        for block in held:
            if view.parents.get(block) == parent and view.extra.get(block) == extra:
                kid = view.tokens[block]
                run = 0
                while run < min(len(kid), len(rest)) and kid[run] == rest[run]:
                    run += 1
                best = max(best, run)
    return matched + best


class Churn:
    """Random operations on a small store: every kind a router must follow."""

    def __init__(self, seed: int, families: int = 40, restart_rate: float = 0.0015):
        self.rng = random.Random(seed)
        self.restart_rate = restart_rate
        self.prefixes = [[self.rng.randrange(1, 5000) for _ in range(self.rng.randrange(4, 17))]
                         for _ in range(families)]
        self.stored: list[tuple[int, list[int]]] = []  # (model index, tokens) ever stored

    def sequence(self) -> list[int]:
        rng = self.rng
        base = rng.choice(self.prefixes)
        cut = rng.randrange(1, len(base) + 1)
        return base[:cut] + [rng.randrange(1, 5000) for _ in range(rng.randrange(0, 9))]

    def ops(self, n: int) -> Iterator[tuple[str, int, list[int]]]:
        rng = self.rng
        done = 0
        while done < n:
            r = rng.random()
            done += 1
            if r >= 0.46 and not self.stored:
                yield "lookup", 0, [1]
                continue
            if r < 0.0015:
                if rng.random() < self.restart_rate / 0.0015:
                    yield "restart", 0, []
                else:
                    yield "lookup", 0, [1]
            elif r < 0.003:
                yield "drop_model", rng.randrange(len(MODELS)), []
            elif r < 0.43:
                model, tokens = rng.randrange(len(MODELS)), self.sequence()
                self.stored.append((model, tokens))
                yield "store", model, tokens
            elif r < 0.46:
                yield "store_chunk", rng.randrange(len(MODELS)), self.sequence()
            elif r < 0.85:
                model, tokens = rng.choice(self.stored[-400:])
                yield "fetch", model, tokens
            else:
                model, tokens = rng.choice(self.stored)
                yield "lookup", model, tokens


class MemorySubscriber:
    """The store's events through an in-memory log (the connector's in-process path)."""

    def __init__(self) -> None:
        self.log = KVEventLog()
        self.view = KVEventView()
        self.store: KVStore | None = None

    def attach(self, store: KVStore) -> None:
        self.store = store
        store.attach_kv_events(self.log)

    def catch_up(self) -> None:
        self.view.apply(self.log.take(self.store))

    def close(self) -> None:
        pass


class ZmqSubscriber:
    """The store's events through the sidecar's publisher and real ZeroMQ sockets, read as a
    subscriber should: a SUB socket, and the ROUTER for what it missed (the batches sent before it
    joined, a gap in the sequence numbers): kvstore.kv_events.subscriber."""

    def __init__(self) -> None:
        from kvstore.kv_events.publisher import KVEventsPublisher, KVEventsPublisherConfig

        self._config = KVEventsPublisherConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                               batch_interval_s=0.002)
        self._make = KVEventsPublisher
        self.publisher: Any = None
        self.source: Any = None
        self.view = KVEventView()

    def attach(self, store: KVStore) -> None:
        from kvstore.kv_events.subscriber import SidecarEventSource

        if self.publisher is not None:  # a restart: the old sidecar's publisher goes with it
            self.catch_up()
            self.close()
        self.publisher = self._make(self._config)
        self.publisher.start(store)
        self.source = SidecarEventSource(self.publisher.endpoint, self.publisher.replay_endpoint)

    def catch_up(self, timeout_s: float = 30.0) -> None:
        """Apply everything the publisher has sent so far."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.view.apply(self.source.take())
            if self.publisher.queued == 0 and (self.source.next_seq or 0) >= self.publisher._seq:
                return
            if time.monotonic() > deadline:
                raise TimeoutError(f"subscriber at seq {self.source.next_seq}, publisher at {self.publisher._seq}")
            time.sleep(0.002)

    def close(self) -> None:
        if self.publisher is not None:
            self.publisher.close()
            self.source.close()


def run_exactness(ops: int, checkpoint_every: int, data_dir: str, seed: int = 0, zmq: bool = False,
                  progress: bool = False, restart_rate: float = 0.0015) -> Exactness:
    churn = Churn(seed, restart_rate=min(restart_rate, 0.0015))
    subscriber: Any = ZmqSubscriber() if zmq else MemorySubscriber()
    result = Exactness()

    def open_store() -> KVStore:
        store = KVStore(StoreConfig(data_dir=data_dir, cpu_bytes=48 << 10, disk_bytes=1 << 20, policy="lru-tail"))
        for name, tenant in MODELS:
            store.register_model(name, SPEC, tenant=tenant)
        subscriber.attach(store)
        return store

    def count_moves(store: KVStore) -> None:
        for tier, stats in store.stats()["tiers"].items():
            for what in ("evictions", "demotions", "promotions"):
                key = f"{tier} {what}"
                result.moves[key] = result.moves.get(key, 0) + stats[what]

    store = open_store()
    gen = torch.Generator().manual_seed(seed)
    try:
        for i, (op, m, tokens) in enumerate(churn.ops(ops), 1):
            result.ops[op] = result.ops.get(op, 0) + 1
            name, tenant = MODELS[m]
            if op == "restart":
                subscriber.catch_up()
                count_moves(store)
                store.close()
                store = open_store()
            elif op == "drop_model":
                store.drop_model(name, tenant=tenant)
                store.register_model(name, SPEC, tenant=tenant)
            elif op == "store":
                store.store(name, tokens, torch.randn(SPEC.kv_shape(len(tokens)), generator=gen), tenant=tenant)
            elif op == "store_chunk":
                store.store_chunk(name, tokens, torch.randn(SPEC.kv_shape(len(tokens)), generator=gen), tenant=tenant)
            elif op == "fetch":
                store.fetch(name, tokens, tenant=tenant)
            else:
                store.lookup(name, tokens, tenant=tenant)
            if i % checkpoint_every == 0 or i == ops:
                result.checkpoints.append(check(store, subscriber, churn, i))
                if progress:
                    c = result.checkpoints[-1]
                    print(f"\r{i}/{ops} ops: {c.pages} pages, missing {c.missing}, phantom {c.phantom}, "
                          f"lookup mismatches {c.lookup_mismatches}", end="", file=sys.stderr, flush=True)
        result.events = subscriber.view.applied
        count_moves(store)
    finally:
        store.close()
        subscriber.close()
    if progress:
        print(file=sys.stderr)
    return result


def check(store: KVStore, subscriber: Any, churn: Churn, ops: int, lookups: int = 50) -> Checkpoint:
    # A copy a tier lost on its own (a disk write refused when the file is full) is forgotten, and
    # reported, at the store's next operation: let the writer finish and the store notice first.
    store.flush()
    store.lookup(MODELS[0][0], [0])
    subscriber.catch_up()
    view = subscriber.view
    truth = store_picture(store)
    missing = phantom = pages = 0
    for medium in set(truth) | set(view.held):
        have, seen = truth.get(medium, set()), view.held.get(medium, set())
        pages += len(have)
        missing += len(have - seen)
        phantom += len(seen - have)
    mismatches = 0
    sample = churn.rng.sample(churn.stored, min(lookups, len(churn.stored)))
    for m, tokens in sample:
        name, tenant = MODELS[m]
        entry = store._registry.get(name, tenant)
        predicted = predicted_match(view, entry.namespace, (name, tenant), tokens, SPEC.page_size)
        mismatches += predicted != store.lookup(name, tokens, tenant=tenant).matched_tokens
    return Checkpoint(ops, pages, missing, phantom, len(sample), mismatches)


# -- cost ----------------------------------------------------------------------------------------
def run_cost(rounds: int, calls: int, data_dir: str, batch_interval_s: float = 0.1) -> dict[str, Any]:
    """One-page store (each evicts) and fetch, events off vs on, alternating blocks in one run."""
    from kvstore.kv_events.publisher import KVEventsPublisher, KVEventsPublisherConfig

    spec = ModelSpec(num_layers=2, num_kv_heads=8, head_dim=64, dtype="float16", page_size=16)
    store = KVStore(StoreConfig(data_dir=data_dir, cpu_bytes=256 * spec.page_bytes, disk_bytes=0))
    store.register_model("m", spec)
    kv = torch.randn(spec.kv_shape(spec.page_size)).to(torch.float16)
    publisher = KVEventsPublisher(KVEventsPublisherConfig(endpoint="tcp://127.0.0.1:*",
                                                          batch_interval_s=batch_interval_s))
    seqs = iter(range(10 ** 9))
    hot = [[7, n] + list(range(100, 100 + spec.page_size - 2)) for n in range(64)]
    for tokens in hot:
        store.store("m", tokens, kv)
    settle_collector()
    times: dict[str, list[float]] = {k: [] for k in ("store off", "store on", "fetch off", "fetch on")}
    # CPU time of the whole process over the blocks (the publisher's thread included): what events
    # cost in work, apart from what the machine's other processes do to the wall clock.
    cpu: dict[str, float] = dict.fromkeys(times, 0.0)
    started = False
    try:
        for round_ in range(rounds):
            # Each round swaps which comes first, so neither state always runs after the other
            # (a warmer cache, a fresher allocator) and an order effect cancels over the rounds.
            for events in ("off", "on") if round_ % 2 == 0 else ("on", "off"):
                if events == "on":
                    if not started:
                        publisher.start(store)
                        started = True
                    else:
                        store.attach_kv_events(publisher)
                for _ in range(4):  # blocks of calls, alternating store and fetch
                    t0, c0 = time.perf_counter(), time.process_time()
                    for _ in range(calls // 4):
                        n = next(seqs)
                        store.store("m", [1, n // 65536, n % 65536] + list(range(spec.page_size - 3)), kv)
                    times[f"store {events}"].append((time.perf_counter() - t0) / (calls // 4))
                    cpu[f"store {events}"] += time.process_time() - c0
                    t0, c0 = time.perf_counter(), time.process_time()
                    for j in range(calls // 4):
                        store.fetch("m", hot[j % len(hot)])
                    times[f"fetch {events}"].append((time.perf_counter() - t0) / (calls // 4))
                    cpu[f"fetch {events}"] += time.process_time() - c0
                if events == "on":
                    store.detach_kv_events(publisher)
    finally:
        publisher.close()
        store.close()
    best = {k: sorted(v)[len(v) // 2] for k, v in times.items()}  # median block
    return {"us": {k: v * 1e6 for k, v in best.items()},
            "store_on_over_off": best["store on"] / best["store off"],
            "fetch_on_over_off": best["fetch on"] / best["fetch off"],
            "cpu_store_on_over_off": cpu["store on"] / cpu["store off"],
            "cpu_fetch_on_over_off": cpu["fetch on"] / cpu["fetch off"],
            # the publisher packs a block's events during whichever block follows: both together
            "cpu_both_on_over_off": (cpu["store on"] + cpu["fetch on"]) / (cpu["store off"] + cpu["fetch off"]),
            "published_events": publisher.published_events, "batches": publisher.published_batches,
            "dropped": publisher.dropped, **event_costs(spec)}


def event_costs(spec: ModelSpec, n: int = 20_000) -> dict[str, float]:
    """What each part costs, alone: the store's report of one page (placement -> recorder -> a
    sink's append) and the publisher's packing of one event (kvstore/kv_events/packing.py)."""
    from kvstore.index import PageIndex
    from kvstore.kv_events.packing import RecordPacker
    from kvstore.kv_events.recorder import KVEventRecorder
    from kvstore.registry import ModelRegistry

    registry = ModelRegistry(None)
    model, _ = registry.register("m", spec, None)
    index = PageIndex()
    node = index.insert(index.root(model.namespace, model.namespace), b"k" * 16, bytes(4 * spec.page_size))
    node.ready = True
    log = KVEventLog(max_records=4 * n)
    recorder = KVEventRecorder(registry)
    recorder.attach(log, index)
    log.take_records()
    t0 = time.perf_counter()
    for _ in range(n):
        recorder.stored(node, "cpu")
        recorder.removed(node, "cpu")
    report_us = (time.perf_counter() - t0) / (2 * n) * 1e6
    records = log.take_records()
    packer = RecordPacker()
    t0 = time.perf_counter()
    for i in range(0, len(records), 1000):
        packer.pack(0.0, records[i:i + 1000], 0)
    pack_us = (time.perf_counter() - t0) / len(records) * 1e6
    return {"report_us_per_event": report_us, "pack_us_per_event": pack_us}


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--ops", type=int, default=100_000)
    parser.add_argument("--checkpoint-every", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--zmq", action="store_true", help="subscribe through the publisher's ZeroMQ sockets")
    parser.add_argument("--cost-rounds", type=int, default=5)
    parser.add_argument("--cost-calls", type=int, default=2000)
    parser.add_argument("--batch-interval-s", type=float, default=0.1, help="the publisher's, in the cost run")
    args = parser.parse_args(argv)
    out: dict[str, Any] = {}
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.perf_counter()
        exact = run_exactness(args.ops, args.checkpoint_every, str(Path(tmp) / "churn"), args.seed, args.zmq,
                              progress=sys.stderr.isatty())
        worst = max(exact.checkpoints, key=lambda c: c.missing + c.phantom + c.lookup_mismatches)
        print(f"exactness ({'zmq' if args.zmq else 'in-memory'} subscriber): {args.ops} ops {exact.ops}, "
              f"{exact.events} events, {exact.moves}, {len(exact.checkpoints)} checkpoints, "
              f"worst: missing {worst.missing}, phantom {worst.phantom}, lookup mismatches {worst.lookup_mismatches} "
              f"of {worst.lookups}; max pages held {max(c.pages for c in exact.checkpoints)} "
              f"({time.perf_counter() - t0:.0f} s) -> {'exact' if exact.exact else 'NOT EXACT'}")
        out["exactness"] = {"ops": args.ops, "by_op": exact.ops, "events": exact.events, "moves": exact.moves,
                            "exact": exact.exact,
                            "checkpoints": [c.__dict__ for c in exact.checkpoints]}
        if args.cost_rounds:
            cost = run_cost(args.cost_rounds, args.cost_calls, str(Path(tmp) / "cost"), args.batch_interval_s)
            us = cost["us"]
            print(f"cost: store {us['store off']:.1f} us off, {us['store on']:.1f} us on "
                  f"({cost['store_on_over_off']:.3f}x); fetch {us['fetch off']:.1f} us off, {us['fetch on']:.1f} us on "
                  f"({cost['fetch_on_over_off']:.3f}x); target <= 1.05x; process CPU time on/off: store "
                  f"{cost['cpu_store_on_over_off']:.3f}x, fetch {cost['cpu_fetch_on_over_off']:.3f}x, "
                  f"both {cost['cpu_both_on_over_off']:.3f}x; "
                  f"{cost['published_events']} events in {cost['batches']} batches, {cost['dropped']} dropped; "
                  f"alone: {cost['report_us_per_event']:.2f} us to report an event, "
                  f"{cost['pack_us_per_event']:.2f} us to pack one")
            out["cost"] = cost
    write_json(args.json, out)
    return 0 if exact.exact else 1


if __name__ == "__main__":
    sys.exit(main())
