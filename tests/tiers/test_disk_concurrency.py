"""The disk tier under concurrent use, as a caller sees it: a record is readable (bit-exact, and
landed in the caller's rows) the moment `put` returns, before its commit, and a delete hides it
at once; reads that run while the writer grows the LMDB map return every record bit-exact."""
from __future__ import annotations

import threading

import numpy as np
import torch

import kvstore.tiers.disk
from kvstore.tiers.base import PageRecord
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.redis_landing import Landing


def page(i: int, nbytes: int) -> PageRecord:
    payload = torch.from_numpy(np.random.default_rng(i).integers(0, 256, nbytes, dtype=np.uint8))
    return PageRecord(namespace=b"ns", key=b"key-%04d" % i, parent=b"ns", tokens=i.to_bytes(4, "little") * 4,
                      codec="none", dtype="float16", shape=(1, 2, 4, 1, nbytes // 16), payload=payload)


def landing_for(record: PageRecord, rows: np.ndarray) -> Landing:
    return Landing(rows, lambda header: header.tokens == record.tokens)


def payload_bytes(record: PageRecord | None) -> bytes | None:
    if record is None:
        return None
    payload = record.payload
    return payload.rows.tobytes() if isinstance(payload, Landing) else bytes(payload.numpy())


def test_a_put_is_read_back_before_its_commit_and_a_delete_hides_it_at_once(tmp_path):
    tier = DiskTier(str(tmp_path / "pages"), 8 << 20)
    release = threading.Event()
    commit = tier._commit

    def held_commit(ops):  # the writer thread waits here: nothing below is committed yet
        release.wait(30)
        return commit(ops)

    tier._commit = held_commit  # type: ignore[method-assign]
    try:
        first, second = page(1, 4096), page(2, 4096)
        ticket = tier.put(first)
        tier.put(second)
        assert not ticket.is_set()  # still queued
        assert payload_bytes(tier.get(first.key)) == payload_bytes(first)
        rows = np.zeros((2, 2048), dtype=np.uint8)
        [found] = tier.read_ahead([[first.key, second.key]], {first.key: landing_for(first, rows)})
        # A pending record is served as it was put.
        assert payload_bytes(found[first.key]) == payload_bytes(first)
        assert payload_bytes(found[second.key]) == payload_bytes(second)
        tier.delete(second.key)
        assert tier.get(second.key) is None and second.key not in tier
        release.set()
        assert ticket.wait(30) and ticket.ok and tier.flush(30)
        [found] = tier.read_ahead([[first.key, second.key]], {first.key: landing_for(first, rows)})
        assert found[first.key].payload.rows is rows and rows.tobytes() == payload_bytes(first)
        assert found[second.key] is None and tier.corrupt_records == 0
    finally:
        release.set()
        tier.close()


def test_reads_while_the_writer_grows_the_map_are_bit_exact(tmp_path, monkeypatch):
    monkeypatch.setattr(kvstore.tiers.disk, "INITIAL_MAP_BYTES", 1 << 20)  # grows several times below
    tier = DiskTier(str(tmp_path / "pages"), 64 << 20)
    try:
        nbytes = 64 << 10
        kept = [page(i, nbytes) for i in range(4)]
        for record in kept:
            tier.put(record)
        assert tier.flush(30)
        start_map = tier.env.info()["map_size"]
        stop, wrong, reads = threading.Event(), [], [0]

        def reader() -> None:
            rows = [np.zeros((2, nbytes // 2), dtype=np.uint8) for _ in kept]
            while not stop.is_set():
                landings = {r.key: landing_for(r, rows[i]) for i, r in enumerate(kept)}
                for found in tier.read_ahead([[r.key for r in kept]], landings):
                    for i, r in enumerate(kept):
                        if payload_bytes(found[r.key]) != payload_bytes(r):
                            wrong.append(r.key)
                reads[0] += 1

        threads = [threading.Thread(target=reader) for _ in range(2)]
        for t in threads:
            t.start()
        for i in range(4, 4 + 160):  # 10 MiB of new records: the map doubles from 1 MiB
            tier.put(page(i, nbytes))
        assert tier.flush(60)
        stop.set()
        for t in threads:
            t.join(30)
        assert tier.env.info()["map_size"] >= 8 * start_map
        assert not wrong and reads[0] > 0 and tier.corrupt_records == 0 and tier.write_errors == 0
        assert payload_bytes(tier.get(b"key-%04d" % 163)) == payload_bytes(page(163, nbytes))
    finally:
        tier.close()
