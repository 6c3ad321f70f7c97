"""Crash scenario: SIGKILL a `kvstore serve` under a store load at random moments and restart it on
the same data dir; acknowledged pages must come back bit-exact. Run by `python bench/chaos.py`;
what is checked and the figures: README.md, "Reliability".
"""
from __future__ import annotations

import random
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

from kvstore.api.client import KVStoreClient
from bench.reliability.pages import SPEC, expected_kv, served_wrong
from bench.engines import Sidecar, serve_args
from kvstore.errors import BackendUnavailable, KVStoreError


@dataclass
class CrashReport:
    durability: str
    rounds: int = 0
    acked_stores: int = 0  # stores the sidecar answered 200 before it was killed
    unacked_stores: int = 0  # stores in flight when it was killed
    checked_sequences: int = 0  # fetches after a restart compared with what was stored
    lost_acked: int = 0  # acknowledged sequences not fully served after the restart
    wrong_kv: int = 0  # fetches whose bytes differ from what was stored (must be 0)
    over_served: int = 0  # fetches that matched more tokens than any store sent (must be 0)
    repairs: int = 0  # restarts where LMDB was moved aside or a record read as corrupt
    restart_s: list[float] = field(default_factory=list)

    @property
    def ok(self) -> bool:
        durable = self.durability != "write-through" or self.lost_acked == 0
        return durable and self.wrong_kv == 0 and self.over_served == 0 and self.repairs == 0


@dataclass
class _Load:
    acked: list[list[int]] = field(default_factory=list)
    unacked: list[list[int]] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


def run_crash(data_dir: Path, *, rounds: int, durability: str, load_s: float = 0.6, threads: int = 4,
              seed: int = 0, sample_old: int = 40) -> CrashReport:
    rng = random.Random(seed)
    report = CrashReport(durability)
    sidecar = Sidecar(data_dir, [*serve_args("8MiB", "256MiB"), "--durability", durability])
    history: list[list[int]] = []  # every sequence acknowledged in earlier rounds
    previous = _Load()
    for rnd in range(rounds + 1):  # the last start only checks the last round
        began = time.perf_counter()
        sidecar.start()
        report.restart_s.append(time.perf_counter() - began)
        try:
            with KVStoreClient(sidecar.url, timeout_s=30) as client:
                client.register_model("m", SPEC)  # idempotent: models.json survived the kill
                _check(client, report, previous, rng.sample(history, min(sample_old, len(history))))
                stats = client.stats()
                quarantined = list(Path(data_dir).glob("pages.corrupt-*"))
                report.repairs += int(bool(quarantined) or stats["corrupt_records"] > 0)
            history += previous.acked
            if rnd == rounds:
                break
            previous = _run_load(sidecar, rnd, rng.uniform(0.15, load_s), threads, rng.random())
            report.rounds += 1
            report.acked_stores += len(previous.acked)
            report.unacked_stores += len(previous.unacked)
        finally:
            sidecar.kill()
    return report


def _check(client: KVStoreClient, report: CrashReport, load: _Load, old: list[list[int]]) -> None:
    for tokens, must_have in [(t, True) for t in load.acked + old] + [(t, False) for t in load.unacked]:
        result = client.fetch("m", tokens)
        report.checked_sequences += 1
        if result.matched_tokens > len(tokens):
            report.over_served += 1
        elif served_wrong(SPEC, tokens, result):
            report.wrong_kv += 1
        if must_have and result.matched_tokens < len(tokens):
            report.lost_acked += 1


def _run_load(sidecar: Sidecar, rnd: int, load_s: float, threads: int, extend_p: float) -> _Load:
    load = _Load()
    workers = [threading.Thread(target=_client_loop, args=(sidecar.url, load, rnd * 1_000_000 + i * 100_000,
                                                           random.Random(rnd * 100 + i), extend_p))
               for i in range(threads)]
    for w in workers:
        w.start()
    time.sleep(load_s)
    sidecar.kill()  # mid-load: stores are in flight in every thread
    for w in workers:
        w.join(60)
    return load


def _client_loop(url: str, load: _Load, next_token: int, rng: random.Random, extend_p: float) -> None:
    mine: list[list[int]] = []
    with KVStoreClient(url, timeout_s=30) as client:
        while True:
            if mine and rng.random() < extend_p:  # extend an acknowledged sequence (start=)
                prefix = rng.choice(mine)
                n_new = rng.randint(1, 40)
            else:
                prefix, n_new = [], rng.randint(1, 80)  # up to 5 pages of 16, tails included
            tokens = prefix + list(range(next_token, next_token + n_new))
            next_token += n_new
            kv = expected_kv(SPEC, tokens)[:, :, len(prefix):]  # (L, 2, n_new, H, D)
            try:
                result = client.store("m", tokens, kv, start=len(prefix))
            except BackendUnavailable:
                with load.lock:
                    load.unacked.append(tokens)
                return
            except KVStoreError:
                continue
            with load.lock:
                (load.acked if result.stored_tokens == len(tokens) else load.unacked).append(tokens)
            mine.append(tokens)
