"""Damaged disk tiers: no fetch returns KV that differs from what was stored; damaged records are
misses, deleted and counted on /metrics; a damaged LMDB environment is moved aside, never a crash.
Each damaged store is opened in a child process, so a crash is a failed assertion here, not a
dead test run."""
from __future__ import annotations

import random
import struct

import lmdb
import pytest

from bench.reliability.corruption import PAGE_BYTES, P_BRANCH, run_flips, run_page_damage, run_payloads
from bench.reliability.pages import SPEC, expected_kv
from kvstore import KVStore, StoreConfig
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.disk_open import walk

pytestmark = pytest.mark.heavy  # a child process per damaged reopening


def test_damaged_leaf_and_branch_pages_never_kill_the_store_nor_serve_wrong_kv(tmp_path):
    report = run_page_damage(tmp_path, trials=50, seed=16)
    assert report.trials == 50 and report.pages_damaged >= 50
    assert report.killed == 0 and report.failed == [], report.failed
    assert report.fetches == 50 * 60 and report.wrong_kv == 0
    assert report.stored_after == 50 * 3 and report.stored_after_wrong == 0  # and it keeps storing
    assert 0 < report.quarantined < 50 and report.served_tokens > 0  # not every damaged byte costs everything


@pytest.mark.slow
def test_five_hundred_damaged_reopenings(tmp_path):
    report = run_page_damage(tmp_path, trials=500, seed=17)
    assert report.killed == 0 and report.failed == [] and report.wrong_kv == 0 and report.stored_after_wrong == 0


def test_flipped_bytes_of_data_mdb_never_serve_wrong_kv(tmp_path):
    report = run_flips(tmp_path, trials=6, flips=(1, 8, 64, 512))
    assert report.killed == 0 and report.failed == [], report.failed
    assert report.fetches == 6 * 60 and report.wrong_kv == 0
    assert report.served_tokens > 0  # a few flipped bytes do not lose everything


def _filled(tmp_path, sequences: int = 30) -> tuple[str, list[list[int]]]:
    data_dir = tmp_path / "data"
    stored = []
    config = StoreConfig(data_dir=str(data_dir), cpu_bytes=0, disk_bytes=16 << 20, durability="write-through")
    with KVStore(config) as store:
        store.register_model("m", SPEC)
        for i in range(sequences):
            tokens = list(range(i * 100, i * 100 + 48))
            store.store("m", tokens, expected_kv(SPEC, tokens))
            stored.append(tokens)
    return str(data_dir / "pages"), stored


def _nodes(raw: bytes | bytearray, pgno: int) -> list[int]:
    base = pgno * PAGE_BYTES
    lower = struct.unpack_from("<H", raw, base + 12)[0]
    return [struct.unpack_from("<H", raw, base + 16 + 2 * i)[0] for i in range((lower - 16) // 2)]


def _live_data_leaf_nodes(raw: bytes | bytearray) -> list[tuple[int, int]]:
    """(page base, node offset) of the nodes of the `data` sub-database's first live leaf page,
    found from the committed meta page down (free pages keep stale copies of old leaves)."""
    metas = [struct.unpack_from("<Q", raw, pgno * PAGE_BYTES + 16 + 128)[0] for pgno in (0, 1)]  # mm_txnid
    meta = max((0, 1), key=lambda pgno: metas[pgno]) * PAGE_BYTES + 16
    main_root = struct.unpack_from("<Q", raw, meta + 24 + 48 + 40)[0]  # mm_dbs[MAIN_DBI].md_root
    for node in _nodes(raw, main_root):
        at = main_root * PAGE_BYTES + node
        ksize = struct.unpack_from("<H", raw, at + 6)[0]
        if raw[at + 8:at + 8 + ksize] == b"data":
            pgno = struct.unpack_from("<Q", raw, at + 8 + ksize + 40)[0]  # its MDB_db's md_root
            break
    else:
        raise AssertionError("no data sub-database")
    while struct.unpack_from("<H", raw, pgno * PAGE_BYTES + 10)[0] == P_BRANCH:  # down to the first leaf
        lo, hi, top = struct.unpack_from("<HHH", raw, pgno * PAGE_BYTES + _nodes(raw, pgno)[0])
        pgno = lo | hi << 16 | top << 32
    return [(pgno * PAGE_BYTES, node) for node in _nodes(raw, pgno)]


@pytest.mark.parametrize("field", ["value size", "overflow page number"])
def test_a_damaged_value_extent_in_a_data_leaf_moves_the_environment_aside(tmp_path, field):
    """The damage the old key-only walk let through, and whose first read ran off data.mdb."""
    path, _ = _filled(tmp_path)
    data_file = f"{path}/data.mdb"
    raw = bytearray(open(data_file, "rb").read())
    nodes = _live_data_leaf_nodes(raw)
    # every node: flags F_BIGDATA, 16-byte keys
    assert nodes and all(struct.unpack_from("<HH", raw, b + n + 4) == (0x01, 16) for b, n in nodes)
    base, node = random.Random(5).choice(nodes)
    if field == "value size":
        struct.pack_into("<H", raw, base + node + 2, 0x4000)  # mn_hi: the value claims 1 GiB more
    else:
        struct.pack_into("<Q", raw, base + node + 8 + 16, 3)  # the value lives at page 3 (someone else's)
    open(data_file, "wb").write(raw)
    problem = walk(path)
    assert problem is not None and problem.startswith("lmdb.verify:"), problem
    tier = DiskTier(path, 16 << 20)
    try:
        assert len(tier) == 0  # moved aside: the tier starts empty instead of reading it
    finally:
        tier.close()
    assert len([p for p in tmp_path.joinpath("data").iterdir() if p.name.startswith("pages.corrupt-")]) == 1


def test_an_undamaged_environment_passes_the_start_check(tmp_path):
    path, stored = _filled(tmp_path)
    assert walk(path) is None
    with KVStore(StoreConfig(data_dir=str(tmp_path / "data"), cpu_bytes=0, disk_bytes=16 << 20)) as store:
        store.register_model("m", SPEC)
        assert all(store.fetch("m", tokens).matched_tokens == len(tokens) for tokens in stored)
        assert store.stats()["corrupt_records"] == 0


def test_corrupt_payloads_and_headers_are_misses_deleted_and_counted(tmp_path):
    report = run_payloads(tmp_path, records=20)
    assert report.wrong_kv == 0
    assert report.served_tokens < report.stored_tokens
    assert 0 < report.corrupt_counted <= 20 and report.corrupt_left == 0


def test_unopenable_environment_is_moved_aside_and_the_tier_starts_empty(tmp_path):
    path = tmp_path / "pages"
    path.mkdir()
    (path / "data.mdb").write_bytes(b"this is not an LMDB file" * 1000)
    tier = DiskTier(str(path), 8 << 20)
    try:
        assert len(tier) == 0
        assert [p.name.startswith("pages.corrupt-") for p in tmp_path.iterdir()].count(True) == 1
    finally:
        tier.close()
    env = lmdb.open(str(path), max_dbs=2, readonly=True)  # the fresh environment is a valid one
    env.close()
