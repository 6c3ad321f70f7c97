"""Same-host shared memory: KV moves through the client's memfd instead of the HTTP body.

What a user sees: the same tensors and results as over the socket; a refused or disabled
arena falls back to the socket with a warning; every bad registration or region is a clear
4xx that names the field, and the store is unchanged by it.
"""
from __future__ import annotations

import fcntl
import gc
import logging
import os
import threading
import time

import pytest
import torch
from api_helpers import MAX_BODY_BYTES, LiveServer, call, sidecar_client
from kv_tensors import random_kv

from kvstore.api.client import KVStoreClient
from kvstore.api.client.arena import ALIGN_BYTES, ClientArena
from kvstore.api.server.config import ServerConfig
from kvstore.api.server.shared_memory import HEADER_BYTES, SECRET_BYTES
from kvstore import ModelSpec
from kvstore.errors import InvalidRequest


def test_fetch_lands_in_shared_memory_and_matches_the_socket(live_server, spec: ModelSpec):
    tokens = list(range(1, 23))
    kv = random_kv(spec, len(tokens))
    with KVStoreClient(live_server.url) as shm, KVStoreClient(live_server.url, shared_memory_bytes=0) as tcp:
        shm.register_model("m", spec)
        assert shm.store("m", tokens, kv).stored_tokens == 22
        first = shm.fetch("m", tokens)  # teaches the client the model's bytes per token (socket)
        second = shm.fetch("m", tokens + [99], start=4)
        over_socket = tcp.fetch("m", tokens + [99], start=4)
        arena = shm._arena
        assert arena is not None
        base = arena.view(0, 1).ctypes.data
        assert torch.equal(first.kv, kv)
        assert second.matched_tokens == over_socket.matched_tokens == 22
        assert torch.equal(second.kv, kv[:, :, 4:]) and torch.equal(over_socket.kv, kv[:, :, 4:])
        assert base <= second.kv.data_ptr() < base + arena.nbytes  # it came through shared memory
        held = arena.nbytes - HEADER_BYTES - arena.free_bytes()
        assert held >= second.kv.numel() * 2
        view = second.kv[0, 1]  # a view keeps the region
        del second
        gc.collect()
        assert arena.nbytes - HEADER_BYTES - arena.free_bytes() == held
        del view
        gc.collect()
        assert arena.free_bytes() == arena.nbytes - HEADER_BYTES  # released with its last view


def test_store_from_shared_memory_then_fetch_over_the_socket(live_server, spec: ModelSpec):
    with KVStoreClient(live_server.url) as shm, KVStoreClient(live_server.url, shared_memory_bytes=0) as tcp:
        shm.register_model("m", spec)
        kv = random_kv(spec, 9, seed=1)
        strided = torch.stack([kv, -kv], dim=-1)[..., 0]  # equal to kv, not contiguous: still stored exactly
        assert not strided.is_contiguous()
        assert shm.store("m", range(100, 109), strided).stored_tokens == 9
        assert shm.store_chunk("m", range(200, 205), kv[:, :, :5]).stored_tokens == 5
        assert torch.equal(tcp.fetch("m", range(100, 109)).kv, kv)
        assert tcp.blend("m", [list(range(200, 205))]).hits == [True]
        assert shm._arena is not None and shm._arena.free_bytes() == shm._arena.nbytes - HEADER_BYTES


def test_answers_larger_than_the_arena_use_the_socket(live_server, spec: ModelSpec):
    with KVStoreClient(live_server.url, shared_memory_bytes=HEADER_BYTES + ALIGN_BYTES) as client:
        client.register_model("m", spec)
        kv = random_kv(spec, 64, seed=2)  # 16 KiB of KV: four times the arena's usable bytes
        assert client.store("m", range(64), kv).stored_tokens == 64
        for _ in range(2):
            assert torch.equal(client.fetch("m", range(64)).kv, kv)


def test_a_sidecar_without_shared_memory_falls_back_with_one_warning(store, spec: ModelSpec, caplog):
    server = LiveServer(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES, shared_memory=False))
    try:
        with caplog.at_level(logging.WARNING, logger="kvstore.client"), KVStoreClient(server.url) as client:
            client.register_model("m", spec)
            kv = random_kv(spec, 8, seed=3)
            for _ in range(3):
                assert client.store("m", range(8), kv).stored_tokens == 8
                assert torch.equal(client.fetch("m", range(8)).kv, kv)
        warnings = [r for r in caplog.records if "refused shared memory" in r.getMessage()]
        assert len(warnings) == 1 and "--no-shared-memory" in warnings[0].getMessage()
    finally:
        server.close()


# ---- the HTTP surface: registration and regions ----------------------------------------------

def _memfd(nbytes: int, secret: bytes, *, seal: bool = True) -> int:
    fd = os.memfd_create("kvstore-test", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, nbytes)
    os.pwrite(fd, secret, 0)
    if seal:
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


ARENA_BYTES = 1 << 20
SECRET = bytes(range(SECRET_BYTES))


@pytest.fixture
def memfd():
    fd = _memfd(ARENA_BYTES, SECRET)
    yield fd
    os.close(fd)


def _registration(memfd: int, **over) -> dict:
    return {"pid": os.getpid(), "fd": memfd, "nbytes": ARENA_BYTES, "secret": SECRET, **over}


@pytest.mark.parametrize("change, code, words", [
    ({"secret": bytes(SECRET_BYTES)}, "shared_memory_refused", "secret"),
    ({"nbytes": ARENA_BYTES * 2}, "shared_memory_refused", "holds"),
    ({"fd": 0}, "shared_memory_refused", "memfd"),
    ({"pid": 1 << 30}, "shared_memory_refused", "cannot open"),
    ({"secret": b"short"}, "invalid_request", "secret"),
    ({"nbytes": 100}, "invalid_request", "nbytes"),
    ({"pid": "me"}, "invalid_request", "pid"),
])
async def test_bad_registrations_are_refused_with_the_reason(http_model, memfd: int, change, code, words):
    status, body = await call(http_model, "POST", "/v1/shm", _registration(memfd, **change))
    assert status == (403 if code == "shared_memory_refused" else 400), body
    assert body["error"]["code"] == code and words in body["error"]["message"]


async def test_an_unsealed_memfd_is_refused(http_model):
    fd = _memfd(ARENA_BYTES, SECRET, seal=False)
    try:
        status, body = await call(http_model, "POST", "/v1/shm", _registration(fd))
        assert status == 403 and "F_SEAL_SHRINK" in body["error"]["message"]
    finally:
        os.close(fd)


async def test_regions_are_checked_and_bound_to_the_connection(http_model, store, spec: ModelSpec, memfd: int):
    kv = random_kv(spec, 8, seed=4)
    raw = kv.contiguous().view(-1).view(torch.uint8).numpy()
    store_body = {"model": "m", "tokens": list(range(8)), "shm": {"offset": HEADER_BYTES, "nbytes": raw.nbytes}}
    # Nothing registered on this connection yet.
    status, body = await call(http_model, "POST", "/v1/store", store_body)
    assert status == 403 and "POST /v1/shm first" in body["error"]["message"]
    status, body = await call(http_model, "POST", "/v1/shm", _registration(memfd))
    assert status == 200 and body == {"nbytes": ARENA_BYTES}
    os.pwrite(memfd, raw.tobytes(), HEADER_BYTES)
    for bad, field_words in ((HEADER_BYTES - ALIGN_BYTES, "outside"), (ARENA_BYTES - 16, "outside")):
        status, body = await call(http_model, "POST", "/v1/store",
                                  {**store_body, "shm": {"offset": bad, "nbytes": raw.nbytes}})
        assert status == 400 and body["error"]["message"].startswith("shm:") and field_words in body["error"]["message"]
    status, body = await call(http_model, "POST", "/v1/store", {**store_body, "kv": raw.tobytes()})
    assert status == 400 and body["error"]["code"] == "invalid_kv" and "exactly one" in body["error"]["message"]
    status, body = await call(http_model, "POST", "/v1/store", {**store_body, "shm": {"offset": HEADER_BYTES}})
    assert status == 400 and "shm" in body["error"]["message"]
    assert store.lookup("m", list(range(8))).matched_tokens == 0  # nothing stored by bad requests
    status, body = await call(http_model, "POST", "/v1/store", store_body)
    assert status == 200 and body["stored_tokens"] == 8
    assert torch.equal(store.fetch("m", list(range(8))).kv, kv)
    # A fetch into the region: the answer names it and the bytes are there.
    os.pwrite(memfd, bytes(raw.nbytes), HEADER_BYTES)
    fetch_body = {"model": "m", "tokens": list(range(8)), "shm": {"offset": HEADER_BYTES, "nbytes": raw.nbytes}}
    status, body = await call(http_model, "POST", "/v1/fetch", fetch_body)
    assert status == 200 and body["shm"] == {"offset": HEADER_BYTES, "nbytes": raw.nbytes} and "kv" not in body
    assert os.pread(memfd, raw.nbytes, HEADER_BYTES) == raw.tobytes()
    # Too small a region: the KV comes in the body instead.
    status, body = await call(http_model, "POST", "/v1/fetch",
                              {**fetch_body, "shm": {"offset": HEADER_BYTES, "nbytes": 8}})
    assert status == 200 and "shm" not in body and bytes(body["kv"]) == raw.tobytes()


async def test_disabled_on_the_server_is_refused(store, spec: ModelSpec, memfd: int):
    async with sidecar_client(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES, shared_memory=False)) as http:
        status, body = await call(http, "POST", "/v1/shm", _registration(memfd))
        assert status == 403 and "--no-shared-memory" in body["error"]["message"]


# ---- the client's allocator ------------------------------------------------------------------

def test_arena_allocates_first_fit_and_merges_on_release():
    arena = ClientArena(HEADER_BYTES + 8 * ALIGN_BYTES)
    try:
        a = arena.allocate(1)  # rounds up to one aligned block
        b = arena.allocate(2 * ALIGN_BYTES)
        c = arena.allocate(ALIGN_BYTES + 1)
        assert (a, b, c) == (HEADER_BYTES, HEADER_BYTES + ALIGN_BYTES, HEADER_BYTES + 3 * ALIGN_BYTES)
        assert arena.allocate(4 * ALIGN_BYTES) is None  # 3 blocks left
        arena.release(b, 2 * ALIGN_BYTES)
        assert arena.allocate(2 * ALIGN_BYTES) == b  # lowest offset first: already-faulted pages
        arena.release(a, 1)
        arena.release(b, 2 * ALIGN_BYTES)
        arena.release(c, ALIGN_BYTES + 1)
        assert arena._free == [(HEADER_BYTES, 8 * ALIGN_BYTES)]  # merged back into one run
        assert bytes(arena.view(0, SECRET_BYTES)) == arena.secret
        with pytest.raises(OSError):
            os.ftruncate(arena.fd, ALIGN_BYTES)  # sealed: the sidecar's mapping can never shrink
    finally:
        arena.close()


def test_a_region_whose_array_dies_while_the_arena_is_locked_comes_back_without_a_deadlock():
    # The collector can free an adopted array's cycle inside allocate or release, on the thread
    # that holds the arena's lock: its release must wait for the lock to be free, not take it.
    arena = ClientArena(HEADER_BYTES + 8 * ALIGN_BYTES)
    try:
        offset = arena.allocate(ALIGN_BYTES)
        holder = [arena.adopt(offset, ALIGN_BYTES, ALIGN_BYTES)]
        free_before = arena.free_bytes()
        done = threading.Event()

        def drop_while_locked() -> None:
            with arena._lock:
                holder.clear()  # the last reference: its release runs here, inside the lock
            done.set()
        worker = threading.Thread(target=drop_while_locked, daemon=True)
        worker.start()
        worker.join(10)
        assert done.is_set(), "the release deadlocked on the arena's own lock"
        assert arena.free_bytes() == free_before + ALIGN_BYTES
        assert arena.allocate(ALIGN_BYTES) == offset  # and it is handed out again
    finally:
        arena.close()


def test_arena_size_is_validated():
    with pytest.raises(ValueError, match="shared_memory_bytes"):
        KVStoreClient("http://127.0.0.1:1", shared_memory_bytes=-1)
    with pytest.raises(ValueError, match="shared_memory_bytes"):
        ClientArena(100)


def test_fetch_into_a_buffer_too_small_or_wrong_is_clear(store, spec: ModelSpec):
    store.register_model("m", spec)
    kv = random_kv(spec, 8)
    store.store("m", list(range(8)), kv)
    small = torch.empty(16, dtype=torch.uint8)
    result = store.fetch("m", list(range(8)), into=small)
    assert torch.equal(result.kv, kv) and result.kv.data_ptr() != small.data_ptr()  # a fresh tensor instead
    for bad in (torch.empty(4096, dtype=torch.float32), torch.empty(64, 64, dtype=torch.uint8), bytearray(4096)):
        with pytest.raises(InvalidRequest, match="into"):
            store.fetch("m", list(range(8)), into=bad)


def test_a_broken_exchange_never_reuses_its_region(live_server, spec: ModelSpec, monkeypatch):
    """A timeout or reset may leave the sidecar still copying into or out of the region: it is
    kept out of use, while an error answer (the sidecar is done with it) gives it back."""
    from kvstore.errors import BackendUnavailable, InvalidTokens, ModelNotFound

    with KVStoreClient(live_server.url) as client:
        client.register_model("m", spec)
        kv = random_kv(spec, 8, seed=5)
        client.store("m", range(8), kv)
        client.fetch("m", range(8))  # learns the bytes per token
        arena = client._arena
        assert arena is not None
        full = arena.free_bytes()
        real_call = client._call
        broken = {"/v1/fetch", "/v1/store"}

        def flaky(method, path, parts=None):
            if path in broken:
                broken.discard(path)
                raise BackendUnavailable(f"{path}: simulated reset")
            return real_call(method, path, parts)

        monkeypatch.setattr(client, "_call", flaky)
        with pytest.raises(BackendUnavailable):
            client.fetch("m", range(8))
        with pytest.raises(BackendUnavailable):
            client.store("m", range(20, 28), kv)
        lost = full - arena.free_bytes()
        assert lost >= 2 * kv.numel() * 2  # both regions stay out of use
        assert torch.equal(client.fetch("m", range(8)).kv, kv)  # later calls use other regions
        client._bytes_per_token[("unknown", "{}")] = spec.bytes_per_token  # as if it had been fetched before
        with pytest.raises(ModelNotFound):
            client.fetch("unknown", range(8))  # names a region; the sidecar answers 404
        with pytest.raises(InvalidTokens):
            client.store("m", [-1] * 8, kv)
        gc.collect()
        assert full - arena.free_bytes() == lost  # error answers and bad input gave theirs back


def test_a_closed_connection_unmaps_its_arena(live_server, spec: ModelSpec):
    from kvstore.api.admin.context import SHARED_MEMORY

    arenas = live_server.app[SHARED_MEMORY]

    async def registered() -> int:
        gc.collect()
        return len(arenas._by_transport)

    for _ in range(3):
        with KVStoreClient(live_server.url) as client:
            client.register_model("m", spec)
            client.store("m", range(8), random_kv(spec, 8))
            assert live_server._call(registered()) >= 1  # this connection's (earlier ones may still be closing)
    deadline = time.monotonic() + 5  # the server sees each close a moment after the client
    while live_server._call(registered()) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert live_server._call(registered()) == 0  # nothing held for connections that are gone
