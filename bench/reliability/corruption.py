"""Corruption scenario: damage the disk tier while the store is stopped, reopen in a child (a crash
is counted, not suffered), fetch everything. Run by `python bench/chaos.py --only corruption`;
the damage and figures: docs/reliability.md, "The chaos table".
"""
from __future__ import annotations

import multiprocessing
import random
import shutil
import struct
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import lmdb

from bench.reliability.pages import SPEC, expected_kv, served_wrong
from kvstore import KVStore, StoreConfig
from kvstore.api.server.metrics import Metrics

PAGE_BYTES = 4096  # LMDB's page size on Linux x86-64 and aarch64 (4 KiB OS pages)
P_BRANCH, P_LEAF = 0x01, 0x02
TRIAL_TIMEOUT_S = 120.0


@dataclass
class CorruptionReport:
    trials: int = 0
    damaged: int = 0  # bytes overwritten, or records rewritten
    pages_damaged: int = 0  # distinct LMDB pages that took those bytes (run_page_damage)
    fetches: int = 0
    served_tokens: int = 0
    stored_tokens: int = 0
    wrong_kv: int = 0  # must be 0
    killed: int = 0  # trials whose process died by a signal (must be 0)
    failed: list[str] = field(default_factory=list)  # trials that raised instead of serving (must be empty)
    quarantined: int = 0  # reopenings where the environment was moved aside
    corrupt_counted: int = 0  # kvstore_corrupt_records on /metrics, summed over trials
    corrupt_left: int = 0  # damaged records still in LMDB after they were read (must be 0)
    stored_after: int = 0  # sequences stored and fetched back right after the damaged reopen
    stored_after_wrong: int = 0  # of those, fetched back wrong or short (must be 0)


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
            # one commit each (write-through): the free list fills with the pages each one replaced
            stored.append(tokens)
    return stored


def _fetch_all(store: KVStore, stored: list[list[int]], report: CorruptionReport) -> None:
    for tokens in stored:
        result = store.fetch("m", tokens)
        report.fetches += 1
        report.stored_tokens += len(tokens)
        report.served_tokens += result.matched_tokens
        report.wrong_kv += result.matched_tokens > len(tokens) or served_wrong(SPEC, tokens, result)


def _corrupt_metric(store: KVStore) -> int:
    for line in Metrics(store.stats).render().decode().splitlines():
        if line.startswith("kvstore_corrupt_records"):
            return int(float(line.split()[-1]))
    raise AssertionError("kvstore_corrupt_records missing from /metrics")


def _serve_damaged(data_dir: str, stored: list[list[int]], fresh: int) -> CorruptionReport:
    """In the trial's child: open the damaged store, fetch every stored sequence, then store and
    fetch `fresh` new ones (the writer allocates pages from the damaged free list)."""
    report = CorruptionReport()
    path = Path(data_dir)
    with KVStore(_config(path)) as store:
        report.quarantined = int(any(path.glob("pages.corrupt-*")))
        store.register_model("m", SPEC)
        _fetch_all(store, stored, report)
        for i in range(fresh):
            tokens = list(range(10_000_000 + i * 1000, 10_000_000 + i * 1000 + 40))
            store.store("m", tokens, expected_kv(SPEC, tokens))
            result = store.fetch("m", tokens)
            report.stored_after += 1
            report.stored_after_wrong += result.matched_tokens != len(tokens) or served_wrong(SPEC, tokens, result)
        report.corrupt_counted = _corrupt_metric(store)
    return report


def _child_main(conn: Any, data_dir: str, stored: list[list[int]], fresh: int) -> None:
    try:
        conn.send(("ok", _serve_damaged(data_dir, stored, fresh)))
    except BaseException as exc:  # noqa: BLE001 - reported to the parent as the trial's failure
        conn.send(("failed", f"{type(exc).__name__}: {exc}"[:300]))
    conn.close()


def _context() -> multiprocessing.context.BaseContext:
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["bench.reliability.corruption"])
    return ctx


def _run_in_child(ctx: Any, data_dir: Path, stored: list[list[int]], fresh: int, report: CorruptionReport) -> None:
    """One damaged reopen in a child; its figures are added to `report`; a death by signal or an
    exception is counted, never raised."""
    receive, send = ctx.Pipe(duplex=False)
    child = ctx.Process(target=_child_main, args=(send, str(data_dir), stored, fresh), daemon=True)
    child.start()
    send.close()
    try:
        got = receive.recv() if receive.poll(TRIAL_TIMEOUT_S) else None
    except EOFError:  # the child died before it answered
        got = None
    child.join(TRIAL_TIMEOUT_S)
    if child.is_alive():
        child.kill()
        child.join()
    report.trials += 1
    if child.exitcode is not None and child.exitcode < 0 and got is None:
        report.killed += 1
        return
    if got is None or got[0] != "ok":
        report.failed.append(got[1] if got else f"no answer (exit status {child.exitcode})")
        return
    part: CorruptionReport = got[1]
    for name in ("fetches", "served_tokens", "stored_tokens", "wrong_kv", "quarantined", "corrupt_counted",
                 "stored_after", "stored_after_wrong"):
        setattr(report, name, getattr(report, name) + getattr(part, name))


def btree_pages(raw: bytes | bytearray) -> list[int]:
    """Page numbers of LMDB's leaf and branch pages: the header stores the page's own number and
    a leaf or branch flag (payload and free pages do not; the two meta pages are left alone)."""
    pages = []
    for pgno in range(2, len(raw) // PAGE_BYTES):
        stored_pgno, _, flags = struct.unpack_from("<QHH", raw, pgno * PAGE_BYTES)
        if stored_pgno == pgno and flags in (P_BRANCH, P_LEAF):
            pages.append(pgno)
    return pages


def _node_field(raw: bytearray, base: int, lower: int, rng: random.Random) -> int | None:
    """Offset in the page of a byte LMDB trusts about one node: its 8-byte header (data size, flags,
    key size) or, in a leaf, the 8 bytes after its key (an overflow page number for a big value)."""
    count = (lower - 16) // 2
    if count <= 0:
        return None
    node = struct.unpack_from("<H", raw, base + 16 + 2 * rng.randrange(count))[0]
    if not 16 <= node <= PAGE_BYTES - 16:
        return None
    ksize = struct.unpack_from("<H", raw, base + node + 6)[0]
    offset = node + rng.randrange(8) if rng.random() < 0.5 else node + 8 + ksize + rng.randrange(8)
    return offset if offset < PAGE_BYTES else None


def _damage_btree_pages(raw: bytearray, rng: random.Random, nbytes: int) -> int:
    """Overwrite `nbytes` bytes inside leaf and branch pages: a third in the fields LMDB trusts
    about a node (sizes, flags, overflow page numbers), a third in the page's used part (header,
    node pointers, keys, inline values), a third anywhere in it. Returns the pages that took them."""
    pages = btree_pages(raw)
    hit = set()
    for _ in range(nbytes):
        pgno = rng.choice(pages)
        base = pgno * PAGE_BYTES
        lower, upper = struct.unpack_from("<HH", raw, base + 12)
        sane = 16 <= lower <= upper <= PAGE_BYTES
        where = rng.randrange(3)
        offset = _node_field(raw, base, lower, rng) if where == 0 and sane else None
        if offset is None and where <= 1 and sane:
            if rng.random() < 0.3 or upper == PAGE_BYTES:
                offset = rng.randrange(0, lower)
            else:
                offset = rng.randrange(upper, PAGE_BYTES)
        if offset is None:
            offset = rng.randrange(PAGE_BYTES)
        raw[base + offset] = rng.randrange(256)
        hit.add(pgno)
    return len(hit)


def _run_trials(work: Path, *, trials: int, sequences: int, seed: int, fresh: int,
                damage: Callable[[bytearray, random.Random, int], int], sizes: tuple[int, ...]) -> CorruptionReport:
    report = CorruptionReport()
    rng = random.Random(seed)
    pristine = work / f"pristine-{seed}"
    stored = _fill(pristine, sequences, seed)
    ctx = _context()
    for trial in range(trials):
        data_dir = work / f"trial{trial}"
        shutil.copytree(pristine, data_dir)
        data_file = data_dir / "pages" / "data.mdb"
        raw = bytearray(data_file.read_bytes())
        n = sizes[trial % len(sizes)]
        report.pages_damaged += damage(raw, rng, n)
        report.damaged += n
        data_file.write_bytes(bytes(raw))
        _run_in_child(ctx, data_dir, stored, fresh, report)
        shutil.rmtree(data_dir)
    shutil.rmtree(pristine)
    return report


def run_page_damage(work: Path, *, trials: int, sequences: int = 60, seed: int = 0, fresh: int = 3) -> CorruptionReport:
    """`trials` reopenings, each after 1-4 bytes of leaf and branch pages were overwritten."""
    return _run_trials(work, trials=trials, sequences=sequences, seed=seed, fresh=fresh,
                       damage=_damage_btree_pages, sizes=(1, 2, 3, 4))


def _flip_anywhere(raw: bytearray, rng: random.Random, nbytes: int) -> int:
    for _ in range(nbytes):
        raw[rng.randrange(len(raw))] = rng.randrange(256)
    return 0


def run_flips(work: Path, *, trials: int, flips: tuple[int, ...] = (1, 8, 64), sequences: int = 60,
              seed: int = 0, fresh: int = 1) -> CorruptionReport:
    """`trials` reopenings, each after `flips` random bytes anywhere in data.mdb were overwritten."""
    return _run_trials(work, trials=trials, sequences=sequences, seed=seed, fresh=fresh,
                       damage=_flip_anywhere, sizes=flips)


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
    # Through LMDB, so the B-tree is sound: this one runs in this process.
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
