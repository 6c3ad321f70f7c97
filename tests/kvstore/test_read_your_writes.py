"""Read-your-writes: once `store` returns `stored_tokens = n`, every lookup and fetch that starts
afterwards, on any thread, matches at least those n tokens (nothing is evicted here).

Several threads storing the same sequence at once is what makes a store meet pages another
thread is still writing: each of them must either wait for those pages or write its own,
never acknowledge tokens nobody can read yet."""
from __future__ import annotations

import threading

import torch

from kvstore import ModelSpec
from kvstore.api.loop_store import LoopStore
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


def test_a_store_that_must_not_wait_refuses_pages_in_flight_and_does_nothing(make_store):
    # Inside LoopStore.unless_busy (the sidecar's event loop) a store that meets pages another thread is
    # writing raises StoreBusy instead of waiting; run again outside, it acknowledges them all.
    spec = ModelSpec(num_layers=8, num_kv_heads=8, head_dim=128, dtype="float16", page_size=16)  # 512 KiB pages
    store = make_store(cpu_bytes=512 << 20, disk_bytes=0)
    store.register_model("m", spec)
    refused = 0
    for attempt in range(20):
        tokens = list(range(attempt * 10_000, attempt * 10_000 + 64 * 16))  # 64 pages: 32 MiB to copy
        kv = torch.zeros(spec.kv_shape(len(tokens)), dtype=torch.float16)
        writer = threading.Thread(target=store.store, args=("m", tokens, kv))
        pages_before = store.stats()["pages"]
        writer.start()
        while store.stats()["pages"] == pages_before and writer.is_alive():
            pass  # until the writer has planned its pages (in the tree, not yet readable)
        with LoopStore(store).unless_busy() as free:
            assert free
            in_flight = store.lookup("m", tokens).matched_tokens == 0
            stores = store.stats()["stores"]
            try:
                result = store.store("m", tokens, kv)
            except StoreBusy:
                refused += 1
                assert in_flight
                assert store.stats()["stores"] == stores  # the refused store did nothing
            else:
                assert not in_flight and result.stored_tokens == len(tokens)
        assert store.store("m", tokens, kv).stored_tokens == len(tokens)
        writer.join()
        assert store.fetch("m", tokens).matched_tokens == len(tokens)
        if refused >= 3:
            break
    assert refused >= 3
