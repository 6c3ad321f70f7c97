"""Work that can wait on I/O never runs on the sidecar's event loop: while a lookup waits for a
Redis that accepts connections but never answers, or for the store's lock that a thread holds
through a slow promotion, the sidecar keeps answering other requests; and a fetch that needs the
disk is planned once, then read on a pool thread."""
from __future__ import annotations

import asyncio
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch
from api_helpers import MAX_BODY_BYTES, LiveServer, call, random_kv, sidecar_client

from kvstore.api.client import KVStoreClient
from kvstore.api.server.config import ServerConfig
from kvstore.api.client.http1 import Connection
from kvstore import KVStore, ModelSpec, StoreConfig

REDIS_TIMEOUT_S = 3.0


def _silent_server() -> tuple[socket.socket, list[socket.socket]]:
    """A TCP listener that accepts connections and never sends a byte (a hung Redis)."""
    listener = socket.create_server(("127.0.0.1", 0))
    accepted: list[socket.socket] = []

    def accept() -> None:
        while True:
            try:
                accepted.append(listener.accept()[0])
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return listener, accepted


async def test_a_hung_redis_does_not_stall_other_requests(tmp_path):
    listener, accepted = _silent_server()
    port = listener.getsockname()[1]
    config = StoreConfig(data_dir=str(tmp_path / "data"), cpu_bytes=16 << 20, disk_bytes=0,
                         redis_url=f"redis://127.0.0.1:{port}", redis_timeout_s=REDIS_TIMEOUT_S)
    spec = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
    try:
        with KVStore(config) as store:
            store.register_model("m", spec)
            async with sidecar_client(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES)) as http:
                began = time.monotonic()
                body = {"model": "m", "tokens": list(range(12))}
                lookup = asyncio.ensure_future(call(http, "POST", "/v1/lookup", body))
                await asyncio.sleep(0.2)  # the lookup is now waiting on Redis
                status, body = await call(http, "GET", "/healthz", headers={})
                healthz_s = time.monotonic() - began
                assert status == 200 and body == {"status": "ok"}
                assert not lookup.done()  # still waiting for Redis...
                assert healthz_s < REDIS_TIMEOUT_S / 2  # ...and the loop answered meanwhile
                status, body = await lookup
                assert status == 200 and body["matched_tokens"] == 0  # Redis gave nothing: a miss, not an error
    finally:
        listener.close()
        for conn in accepted:
            conn.close()


SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
GUARD_S = 30.0  # only a bound on a hang: every wait below ends on an event, not on time


def _disk_only_store(tmp_path, kv: torch.Tensor, *prompts: list[int]) -> StoreConfig:
    """Store `kv` for each prompt, close: reopened, the store holds them on disk only."""
    config = StoreConfig(data_dir=str(tmp_path / "data"), cpu_bytes=16 << 20, disk_bytes=32 << 20)
    with KVStore(config) as store:
        store.register_model("m", SPEC)
        for tokens in prompts:
            assert store.store("m", tokens, kv).new_pages == 2
    return config


def _healthz(server: LiveServer) -> int:
    host, port = server.url.removeprefix("http://").split(":")
    conn = Connection(host, int(port), timeout_s=10)
    try:
        return conn.request(b"GET /healthz HTTP/1.1\r\nHost: x\r\n\r\n", [])[0]
    finally:
        conn.close()


def test_a_lock_held_by_a_slow_promotion_never_stalls_the_loop(tmp_path, monkeypatch):
    kv = random_kv(SPEC, 8, seed=5)
    config = _disk_only_store(tmp_path, kv, list(range(8)), list(range(100, 108)))
    with KVStore(config) as store:
        promoting, gate, looking_up = threading.Event(), threading.Event(), threading.Event()
        fill_slot, lookup = store._tiers.fill_slot, store.lookup

        def slow_promote(*args):  # runs under the store's lock, as a copy into a busy GPU would
            promoting.set()
            gate.wait(GUARD_S)
            fill_slot(*args)

        def lookup_seen(*args, **kwargs):  # the lookup reached a pool thread: it waits for the lock there
            looking_up.set()
            return lookup(*args, **kwargs)

        monkeypatch.setattr(store._tiers, "fill_slot", slow_promote)  # the copy of a promotion
        monkeypatch.setattr(store, "lookup", lookup_seen)
        server = LiveServer(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES))
        try:
            with KVStoreClient(server.url, shared_memory_bytes=0) as first, \
                    KVStoreClient(server.url, shared_memory_bytes=0) as second, ThreadPoolExecutor(2) as pool:
                fetching = pool.submit(first.fetch, "m", list(range(8)))
                assert promoting.wait(GUARD_S)  # the fetch's pool thread holds the lock, promoting
                assert _healthz(server) == 200
                # A lookup of pages the index holds: the fast path answers those on the loop, when
                # the store is free. Now it is not: the lookup goes to a pool thread and waits there.
                looking = pool.submit(second.lookup, "m", list(range(100, 108)))
                assert looking_up.wait(GUARD_S)
                assert _healthz(server) == 200  # the loop answers while both wait behind the lock
                assert not fetching.done() and not looking.done()
                gate.set()
                found = fetching.result(GUARD_S)
                assert found.matched_tokens == 8 and torch.equal(found.kv, kv)
                assert looking.result(GUARD_S).matched_tokens == 8
        finally:
            gate.set()
            server.close()
        assert store.stats()["tiers"]["cpu"]["promotions"] == 2  # the slow promotion did happen


def test_a_fetch_that_needs_the_disk_is_matched_once(tmp_path, monkeypatch):
    kv = random_kv(SPEC, 8, seed=6)
    config = _disk_only_store(tmp_path, kv, list(range(8)))
    with KVStore(config) as store:
        matches = []
        match = store._index.match
        monkeypatch.setattr(store._index, "match", lambda *args: matches.append(args) or match(*args))
        server = LiveServer(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES))
        try:
            with KVStoreClient(server.url, shared_memory_bytes=0) as client:
                found = client.fetch("m", list(range(8)), start=2)
                assert found.matched_tokens == 8 and torch.equal(found.kv, kv[:, :, 2:])
                assert len(matches) == 1  # planned on the loop, read on a pool thread: one match
                found = client.fetch("m", list(range(8)))  # promoted to the CPU tier by the first
                assert found.matched_tokens == 8 and torch.equal(found.kv, kv)
        finally:
            server.close()
        assert store.drop_model("m") == 2  # no pin was left behind: both pages could be dropped
