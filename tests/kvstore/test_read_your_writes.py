"""Read-your-writes: once `store` returns `stored_tokens = n`, every lookup and fetch that starts
afterwards, on any thread, matches at least those n tokens (nothing is evicted here).

Several threads storing the same sequence at once is what makes a store meet pages another
thread is still writing: each of them must either wait for those pages or write its own,
never acknowledge tokens nobody can read yet."""
from __future__ import annotations

import threading

import pytest
import torch

from kvstore import ModelSpec, page_writes
from kvstore.api.server.loop_store import LoopStore
from kvstore.errors import StoreBusy

# 64 KiB pages: each page's copy into the CPU tier takes long enough for other threads to
# reach the same pages while it runs.
SPEC = ModelSpec(num_layers=1, num_kv_heads=8, head_dim=128, dtype="float16", page_size=16)
THREADS = 8


def _kv(tokens: list[int]) -> torch.Tensor:
    """(L, 2, T, H, D): the KV of each token a function of its id, so a wrong page shows."""
    ids = torch.tensor(tokens, dtype=torch.float32)[None, None, :, None, None]
    return (ids % 1024 / 64).expand(SPEC.kv_shape(len(tokens))).to(torch.float16).contiguous()


def _race(store, rounds: int, read) -> list[tuple[int, int]]:
    """`rounds` times: THREADS threads store one new sequence at once (two shared 32-token roots,
    then 7-28 tokens of its own), then each reads it right after its store returned. -> the
    (acknowledged, read) pairs where the read matched less than its store acknowledged."""
    barrier = threading.Barrier(THREADS)
    short: list[tuple[int, int]] = []
    roots = [list(range(r * 1000, r * 1000 + 32)) for r in (1, 2)]

    def worker(i: int) -> None:
        for rnd in range(rounds):
            tokens = roots[rnd % 2] + list(range(100_000 + rnd * 100, 100_000 + rnd * 100 + 7 + rnd % 22))
            kv = _kv(tokens)
            barrier.wait()
            stored = store.store("m", tokens, kv).stored_tokens
            got = read(tokens)
            if got < stored:
                short.append((stored, got))

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not any(t.is_alive() for t in threads), "a store or fetch hung"
    return short


def test_a_fetch_after_a_concurrent_store_returns_sees_what_it_acknowledged(make_store):
    store = make_store(cpu_bytes=64 << 20, disk_bytes=256 << 20)
    store.register_model("m", SPEC)

    def fetch(tokens: list[int]) -> int:
        got = store.fetch("m", tokens)
        assert torch.equal(got.kv, _kv(tokens)[:, :, :got.matched_tokens])
        return got.matched_tokens

    short = _race(store, 150, fetch)
    assert short == [], f"{len(short)} of {150 * THREADS} fetches matched less than their store acknowledged"


def test_a_lookup_after_a_concurrent_store_returns_sees_what_it_acknowledged(make_store):
    store = make_store(cpu_bytes=64 << 20, disk_bytes=256 << 20)
    store.register_model("m", SPEC)
    short = _race(store, 150, lambda tokens: store.lookup("m", tokens).matched_tokens)
    assert short == [], f"{len(short)} of {150 * THREADS} lookups matched less than their store acknowledged"


def test_a_store_that_must_not_wait_refuses_pages_in_flight_and_does_nothing(make_store, monkeypatch):
    # Inside LoopStore.unless_busy (the sidecar's event loop) a store that meets pages another thread is
    # writing raises StoreBusy instead of waiting; run again outside, it acknowledges them all. The
    # writer is held inside its copy (its pages planned, not yet readable) until the refusal is seen,
    # so the race is the same on every run, however the machine schedules the two threads.
    store = make_store(cpu_bytes=64 << 20, disk_bytes=0)
    store.register_model("m", SPEC)
    tokens = list(range(5000, 5000 + 8 * 16))  # 8 pages
    kv = _kv(tokens)
    copying, release = threading.Event(), threading.Event()
    writer_id: list[int] = []
    real_copy = page_writes.copy_all

    def held_copy(copies):
        if threading.get_ident() in writer_id:
            copying.set()
            assert release.wait(30), "the test never released the writer"
        real_copy(copies)

    monkeypatch.setattr(page_writes, "copy_all", held_copy)
    acknowledged: list[int] = []

    def write() -> None:
        writer_id.append(threading.get_ident())
        acknowledged.append(store.store("m", tokens, kv).stored_tokens)

    writer = threading.Thread(target=write)
    writer.start()
    try:
        assert copying.wait(30), "the writer never reached its copy"
        with LoopStore(store).unless_busy() as free:
            assert free  # the writer copies outside the lock
            assert store.lookup("m", tokens).matched_tokens == 0  # planned pages are not readable
            stores = store.stats()["stores"]
            with pytest.raises(StoreBusy):
                store.store("m", tokens, kv)
            assert store.stats()["stores"] == stores  # the refused store did nothing
            assert store.lookup("m", tokens).matched_tokens == 0
    finally:
        release.set()
        writer.join(30)
    assert not writer.is_alive() and acknowledged == [len(tokens)]
    with LoopStore(store).unless_busy() as free:
        assert free
        assert store.store("m", tokens, kv).stored_tokens == len(tokens)  # nothing in flight: no refusal
    got = store.fetch("m", tokens)
    assert got.matched_tokens == len(tokens) and torch.equal(got.kv, kv)
