"""Concurrency scenario: threads (in-process) or sidecar clients run random stores, fetches,
lookups and model drops over overlapping prefixes, and the logged history is checked
(tests/concurrency_history.py). Run by `python bench/chaos.py --only concurrency`; what runs and
what is checked: docs/reliability.md, "The promises".
"""
from __future__ import annotations

import random
import threading
import time
import traceback
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from tests.concurrency_history import (DROP, ERROR, FETCH, FULL, LOOKUP, LOST, NOT_FOUND, STORE, History, OpLog,
                                       check_counters, check_history)
from bench.reliability.pages import SPEC, expected_kv
from bench.engines import Sidecar, serve_args
from kvstore import KVStore, StoreConfig
from kvstore.api.client import KVStoreClient
from kvstore.errors import BackendUnavailable, InsufficientStorage, ModelNotFound

ROOT_TOKENS, MAX_STEM, MAX_TOKENS = 32, 24, 80
BOS = 1
# (cpu_bytes, disk_bytes): room for the whole universe many times over; or a CPU tier of 64
# pages of 4 KiB above a 2 MiB disk tier, both far below the universe's ~400 pages per model.
CAPACITIES = {"nothing evicted": (64 << 20, 256 << 20), "constant eviction": (256 << 10, 2 << 20)}


class Universe:
    """The sequences every operation draws from, their tokens and KV, and what they share."""

    models = ("m0", "m1")

    def __init__(self, roots: int = 6, branches: int = 6, seed: int = 0):
        rng = random.Random(seed)
        self.roots, self.branches = roots, branches
        self.stem = [[rng.randrange(MAX_STEM) for _ in range(branches)] for _ in range(roots)]
        self.tokens: list[list[list[int]]] = []
        self.kv: list[list[torch.Tensor]] = []
        for r in range(roots):
            root = [BOS] + [1000 + r * 100 + i for i in range(1, ROOT_TOKENS)]
            stem = [50_000 + r * 100 + i for i in range(MAX_STEM)]
            row_tokens, row_kv = [], []
            for b in range(branches):
                d = self.stem[r][b]
                own = [100_000 + (r * branches + b) * 100 + i for i in range(MAX_TOKENS - ROOT_TOKENS - d)]
                tokens = root + stem[:d] + own
                row_tokens.append(tokens)
                row_kv.append(expected_kv(SPEC, tokens))  # (L, 2, 80, H, D)
            self.tokens.append(row_tokens)
            self.kv.append(row_kv)

    def common(self, root: int, branch: int, other_root: int, other_branch: int) -> int:
        if root != other_root:
            return 1  # the BOS token
        if branch == other_branch:
            return MAX_TOKENS
        return ROOT_TOKENS + min(self.stem[root][branch], self.stem[root][other_branch])


@dataclass
class ConcurrencyReport:
    path: str  # "in-process", "sidecar (shared memory + TCP)", "sidecar, killed and restarted"
    capacity: str  # a CAPACITIES key
    threads: int
    ops: int = 0
    checked: int = 0  # operations that succeeded, each checked
    by_kind: dict[str, int] = field(default_factory=dict)
    reads: int = 0
    wrong_kv: int = 0
    over_matched: int = 0
    under_matched: int = 0
    counter_mismatches: list[str] = field(default_factory=list)
    unexpected_errors: list[str] = field(default_factory=list)
    evictions: int = 0
    kills: int = 0
    acked_before_kill: int = 0  # stores acknowledged before a kill (restarts: each owed to every later read)
    reads_after_restart: int = 0  # reads answered that began after a restart
    duration_s: float = 0.0
    examples: list[str] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        return not (self.wrong_kv or self.over_matched or self.under_matched or self.counter_mismatches
                    or self.unexpected_errors)


class _Errors:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.seen: list[str] = []

    def add(self, what: str) -> None:
        with self.lock:
            if len(self.seen) < 20:
                self.seen.append(what)


def _worker(backend: Any, universe: Universe, log: OpLog, ops: int, rng: random.Random, p_drop: float,
            errors: _Errors, stop: threading.Event) -> None:
    models, clock = universe.models, time.perf_counter_ns
    for _ in range(ops):
        if stop.is_set():
            return
        x = rng.random()
        m, r, b = rng.randrange(len(models)), rng.randrange(universe.roots), rng.randrange(universe.branches)
        n = rng.randint(1, MAX_TOKENS)
        name, tokens, full_kv = models[m], universe.tokens[r][b][:n], universe.kv[r][b]
        start, pages, kv_ok = 0, 0, True
        if x < p_drop:
            kind = DROP
        elif x < 0.35:
            kind = STORE
            start = rng.randrange(n) if rng.random() < 0.3 else 0
            kv = full_kv[:, :, start:n]  # (L, 2, n - start, H, D)
            if rng.random() < 0.5:
                kv = kv.contiguous()
        elif x < 0.7:
            kind = FETCH
            start = rng.randint(0, n) if rng.random() < 0.3 else 0
        else:
            kind = LOOKUP
        t0 = clock()
        try:
            if kind == STORE:
                stored = backend.store(name, tokens, kv, start=start)
                result, pages = stored.stored_tokens, stored.new_pages
            elif kind == FETCH:
                got = backend.fetch(name, tokens, start=start)
                result = got.matched_tokens
            elif kind == LOOKUP:
                result = backend.lookup(name, tokens).matched_tokens
            else:
                backend.drop_model(name)
                backend.register_model(name, SPEC)
                result = 0
        except ModelNotFound:
            result = NOT_FOUND
        except InsufficientStorage:
            result = FULL
        except BackendUnavailable:
            result = LOST
        except Exception as exc:  # counted as a failure of the run, never swallowed silently
            result = ERROR
            where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}"
                                for f in reversed(traceback.extract_tb(exc.__traceback__)[-4:]))
            errors.add(f"{type(exc).__name__}: {exc} at {where}")
        t1 = clock()
        if kind == FETCH and result >= 0:
            kv_ok = result <= n and torch.equal(got.kv, full_kv[:, :, start:max(start, result)])
        log.add(kind, m, r, b, n, start, t0, t1, result, pages, kv_ok)
        if result == LOST:
            time.sleep(0.05)  # the sidecar is down: do not spin


def _run_workers(backends: list[Any], universe: Universe, ops: int, seed: int, p_drop: float,
                 stop: threading.Event | None = None) -> tuple[list[OpLog], _Errors]:
    logs = [OpLog() for _ in backends]
    errors = _Errors()
    stop = stop or threading.Event()
    per = -(-ops // len(backends))
    workers = [threading.Thread(target=_worker, args=(backend, universe, log, per, random.Random(seed * 1000 + i),
                                                      p_drop, errors, stop))
               for i, (backend, log) in enumerate(zip(backends, logs))]
    for w in workers:
        w.start()
    for w in workers:
        w.join()
    return logs, errors


def _report(path: str, capacity: str, threads: int, logs: list[OpLog], errors: _Errors, universe: Universe,
            stats: dict | None, began: float) -> ConcurrencyReport:
    h = History.of(logs)
    verdict = check_history(h, universe, nothing_evicted=capacity == "nothing evicted")  # read-your-writes
    report = ConcurrencyReport(path, capacity, threads, ops=len(h), checked=int((h.result >= 0).sum()),
                               by_kind={name: h.count(kind) for kind, name in
                                        ((STORE, "stores"), (FETCH, "fetches"), (LOOKUP, "lookups"), (DROP, "drops"))},
                               reads=verdict.reads, wrong_kv=verdict.wrong_kv, over_matched=verdict.over_matched,
                               under_matched=verdict.under_matched, unexpected_errors=errors.seen,
                               examples=verdict.examples)
    if stats is not None:
        report.counter_mismatches = check_counters(h, stats)
        report.evictions = sum(tier["evictions"] for tier in stats["tiers"].values())
    report.duration_s = time.perf_counter() - began
    return report


def run_in_process(data_dir: Path, *, ops: int, capacity: str, threads: int = 8, seed: int = 0,
                   p_drop: float = 0.0002) -> ConcurrencyReport:
    """`threads` threads share one in-process KVStore."""
    began = time.perf_counter()
    universe = Universe(seed=seed)
    cpu_bytes, disk_bytes = CAPACITIES[capacity]
    with KVStore(StoreConfig(data_dir=str(data_dir), cpu_bytes=cpu_bytes, disk_bytes=disk_bytes)) as store:
        for name in universe.models:
            store.register_model(name, SPEC)
        logs, errors = _run_workers([store] * threads, universe, ops, seed, p_drop)
        stats = store.stats()
    return _report("in-process", capacity, threads, logs, errors, universe, stats, began)


def run_sidecar(data_dir: Path, *, ops: int, capacity: str, clients: int = 8, seed: int = 0,
                p_drop: float = 0.0002) -> ConcurrencyReport:
    """`clients` clients, each on its own thread, against one `kvstore serve`: half over shared
    memory, half over TCP."""
    began = time.perf_counter()
    universe = Universe(seed=seed)
    sidecar = Sidecar(data_dir, serve_args(*CAPACITIES[capacity])).start()
    try:
        with KVStoreClient(sidecar.url, timeout_s=30) as admin:
            for name in universe.models:
                admin.register_model(name, SPEC)
            with ExitStack() as opened:
                backends = [opened.enter_context(KVStoreClient(sidecar.url, timeout_s=30, shared_memory_bytes=None
                                                               if i % 2 == 0 else 0)) for i in range(clients)]
                logs, errors = _run_workers(backends, universe, ops, seed, p_drop)
            stats = admin.stats()
    finally:
        sidecar.stop()
    return _report("sidecar (shared memory + TCP)", capacity, clients, logs, errors, universe, stats, began)


def run_restarts(data_dir: Path, *, ops: int, kills: int, clients: int = 8, seed: int = 0,
                 p_drop: float = 0.0002) -> ConcurrencyReport:
    """A write-through sidecar with room for everything, SIGKILLed `kills` times while the clients
    run and started again on the same data dir. Unanswered operations may or may not have happened
    (history.LOST), and counters restart, so only the history's rules are checked. Kill k falls in
    the k-th of `kills + 1` equal stretches of operations (not seconds), so every kill has stores
    acknowledged before it and reads after however slow the host; clients wait while it is down."""
    began = time.perf_counter()
    universe = Universe(seed=seed)
    rng = random.Random(seed)
    sidecar = Sidecar(data_dir, [*serve_args(*CAPACITIES["nothing evicted"]), "--durability", "write-through"]).start()
    done = threading.Event()
    up = threading.Event()
    calls = _Progress()
    stretch = ops / (kills + 1)
    kill_at = [int(stretch * (k + rng.uniform(0.5, 1.0))) for k in range(kills)]
    killed = 0
    kill_ns: list[int] = []
    up_ns: list[int] = []

    def register() -> None:
        with KVStoreClient(sidecar.url, timeout_s=30) as admin:
            for name in universe.models:
                admin.register_model(name, SPEC)  # idempotent: models.json survived the kill

    def killer() -> None:
        nonlocal killed
        for at in kill_at:
            while calls.count < at:
                if done.wait(0.005):
                    return
            up.clear()
            kill_ns.append(time.perf_counter_ns())
            sidecar.kill()
            killed += 1
            sidecar.start()
            register()
            up_ns.append(time.perf_counter_ns())
            up.set()

    try:
        register()
        up.set()
        # The port changes at each start: clients follow the sidecar through a proxy object.
        backends = [_Following(sidecar, up, calls, i % 2 == 0) for i in range(clients)]
        chaos = threading.Thread(target=killer)
        chaos.start()
        try:
            logs, errors = _run_workers(backends, universe, ops, seed, p_drop)
        finally:
            done.set()
            chaos.join()
            for client in backends:
                client.close()
    finally:
        sidecar.kill()
    report = _report("sidecar, write-through, killed and restarted", "nothing evicted", clients, logs, errors,
                     universe, None, began)
    report.kills = killed
    if kill_ns:
        h = History.of(logs)
        answered = h.result >= 0
        report.acked_before_kill = int(((h.kind == STORE) & answered & (h.t1 < kill_ns[-1])).sum())
        report.reads_after_restart = int((((h.kind == FETCH) | (h.kind == LOOKUP)) & answered
                                          & (h.t0 > up_ns[0])).sum())
    return report


class _Progress:
    """Operations started so far, across client threads."""

    def __init__(self) -> None:
        self.count = 0
        self._lock = threading.Lock()

    def add(self) -> None:
        with self._lock:
            self.count += 1


class _Following:
    """A client of whatever URL the sidecar has now (a restart picks a new port); each operation
    waits while the sidecar is down and counts toward the killer's schedule."""

    def __init__(self, sidecar: Sidecar, up: threading.Event, calls: _Progress, shared_memory: bool):
        self.sidecar, self.up, self.calls, self.shared_memory = sidecar, up, calls, shared_memory
        self.url = ""
        self.client: KVStoreClient | None = None

    def _now(self) -> KVStoreClient:
        self.up.wait(60)
        self.calls.add()
        if self.client is None or self.url != self.sidecar.url:
            if self.client is not None:
                self.client.close()
            self.url = self.sidecar.url
            self.client = KVStoreClient(self.url, timeout_s=30, shared_memory_bytes=None if self.shared_memory else 0)
        return self.client

    def __getattr__(self, name: str) -> Any:
        if name in ("store", "fetch", "lookup", "drop_model", "register_model"):
            return getattr(self._now(), name)
        raise AttributeError(name)

    def close(self) -> None:
        if self.client is not None:
            self.client.close()
