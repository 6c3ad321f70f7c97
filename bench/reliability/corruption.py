"""Corruption scenario: damage the disk tier while the store is stopped, reopen, fetch everything.

- `run_flips`: random bytes of `data.mdb` are overwritten (B-tree, meta and payload pages
  alike). LMDB may then refuse to open or fail to read: the disk tier moves the environment
  aside and starts empty (tiers/disk_open.py), so the outcome is "some or all pages lost".
- `run_payloads`: record payloads and headers are rewritten through LMDB (valid B-tree, wrong
  bytes): every damaged record must become a miss, be deleted and be counted.

Either way, no fetch may return KV that differs from what was stored. The store runs in this
process with only a disk tier, so every fetch reads LMDB; /metrics is rendered by the same
`Metrics` the sidecar serves.
"""
from __future__ import annotations

import random
import shutil
from dataclasses import dataclass
from pathlib import Path

import lmdb
import torch

from kvstore.api.metrics import Metrics
from bench.reliability.pages import SPEC, expected_kv
from kvstore import KVStore, StoreConfig


@dataclass
class CorruptionReport:
    trials: int = 0
    damaged: int = 0  # bytes flipped, or records rewritten
    fetches: int = 0
    served_tokens: int = 0
    stored_tokens: int = 0
    wrong_kv: int = 0  # must be 0
    quarantined: int = 0  # reopenings where the environment was moved aside
    corrupt_counted: int = 0  # kvstore_corrupt_records on /metrics, summed over trials
    corrupt_left: int = 0  # damaged records still in LMDB after they were read (must be 0)


def _config(data_dir: Path) -> StoreConfig:
    return StoreConfig(data_dir=str(data_dir), cpu_bytes=0, disk_bytes=64 << 20, durability="write-through")


def _fill(data_dir: Path, sequences: int, seed: int) -> list[list[int]]:
    rng = random.Random(seed)
    stored: list[list[int]] = []
    with KVStore(_config(data_dir)) as store:
        store.register_model("m", SPEC)
        for i in range(sequences):
            tokens = list(range(i * 1000, i * 1000 + rng.randint(1, 80)))
            store.store("m", tokens, expected_kv(SPEC, tokens))
            stored.append(tokens)
    return stored


def _fetch_all(store: KVStore, stored: list[list[int]], report: CorruptionReport) -> None:
    for tokens in stored:
        result = store.fetch("m", tokens)
        report.fetches += 1
        report.stored_tokens += len(tokens)
        report.served_tokens += result.matched_tokens
        if result.matched_tokens > len(tokens) or (
                result.matched_tokens and not torch.equal(result.kv, expected_kv(SPEC, tokens[:result.matched_tokens]))):
            report.wrong_kv += 1


def _corrupt_metric(store: KVStore) -> int:
    for line in Metrics(store.stats).render().decode().splitlines():
        if line.startswith("kvstore_corrupt_records"):
            return int(float(line.split()[-1]))
    raise AssertionError("kvstore_corrupt_records missing from /metrics")


def run_flips(work: Path, *, trials: int, flips: tuple[int, ...] = (1, 8, 64), sequences: int = 60,
              seed: int = 0) -> CorruptionReport:
    report = CorruptionReport()
    rng = random.Random(seed)
    pristine = work / "pristine"
    stored = _fill(pristine, sequences, seed)
    for trial in range(trials):
        data_dir = work / f"trial{trial}"
        shutil.copytree(pristine, data_dir)
        data_file = data_dir / "pages" / "data.mdb"
        raw = bytearray(data_file.read_bytes())
        n = flips[trial % len(flips)]
        for _ in range(n):
            raw[rng.randrange(len(raw))] = rng.randrange(256)
        data_file.write_bytes(bytes(raw))
        report.damaged += n
        with KVStore(_config(data_dir)) as store:
            report.quarantined += int(any(data_dir.glob("pages.corrupt-*")))
            store.register_model("m", SPEC)
            _fetch_all(store, stored, report)
            report.corrupt_counted += _corrupt_metric(store)
        report.trials += 1
        shutil.rmtree(data_dir)
    return report


def run_payloads(work: Path, *, records: int = 20, sequences: int = 60, seed: int = 0) -> CorruptionReport:
    report = CorruptionReport(trials=1)
    rng = random.Random(seed)
    data_dir = work / "payloads"
    stored = _fill(data_dir, sequences, seed)
    env = lmdb.open(str(data_dir / "pages"), max_dbs=2, map_size=64 << 20)
    meta, data = env.open_db(b"meta"), env.open_db(b"data")
    with env.begin(write=True) as txn:
        keys = [key for key, _ in txn.cursor(meta)]
        damaged = rng.sample(keys, min(records, len(keys)))
        for i, key in enumerate(damaged):
            db = meta if i % 4 == 3 else data  # mostly payloads, some headers
            value = bytearray(txn.get(key, db=db))
            if i % 8 == 5:
                value = value[:len(value) // 2]  # truncated
            else:
                value[rng.randrange(len(value))] ^= 1 << rng.randrange(8)  # one flipped bit
            txn.put(key, bytes(value), db=db)
    env.close()
    report.damaged = len(damaged)
    with KVStore(_config(data_dir)) as store:
        store.register_model("m", SPEC)
        _fetch_all(store, stored, report)
        report.corrupt_counted = _corrupt_metric(store)
    env = lmdb.open(str(data_dir / "pages"), max_dbs=2, map_size=64 << 20, readonly=True)
    meta = env.open_db(b"meta", create=False)
    with env.begin() as txn:
        left = [key for key in damaged if txn.get(key, db=meta) is not None]
    env.close()
    report.corrupt_left = len(left)
    return report
