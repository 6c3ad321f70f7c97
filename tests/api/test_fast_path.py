"""The fast path (api/fast_path.py) against a live server: what it answers is what aiohttp would
have answered, what it does not take reaches aiohttp unchanged, and answers keep request order."""
from __future__ import annotations

import importlib.util
import json
import socket
import time
from typing import Any

import msgpack
import pytest
import torch
from api_helpers import MAX_BODY_BYTES, LiveServer, kv_bin, random_kv, tokens_bin

from kvstore.api.client import KVStoreClient
from kvstore.api.config import ServerConfig
from kvstore.api.fast_path import FAST_PATH
from kvstore.api.http1 import Connection
from kvstore import KVStore, ModelSpec, StoreConfig


def _request(path: str, body: bytes, method: str = "POST", **headers: str) -> bytes:
    fields = {"Host": "x", "Content-Type": "application/msgpack", "Content-Length": str(len(body)), **headers}
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
    return head.encode() + body


def _answer(conn: Connection) -> tuple[int, Any]:
    """Read one answer off the connection: (status, decoded body)."""
    status, headers = conn._read_head()
    body = bytes(conn._read_exact(int(headers["content-length"])))
    ctype = headers.get("content-type", "")
    if ctype.startswith("application/json"):
        return status, json.loads(body)
    if ctype.startswith("application/msgpack"):
        return status, msgpack.unpackb(body, raw=False)
    return status, {"text": body}  # aiohttp's own answers to malformed HTTP


def _pack(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


# The fast path only uses asyncio's transport and protocol interfaces: it must behave the same
# on both loops `kvstore serve` may run (api/event_loop.py).
LOOPS = ["asyncio"] + (["uvloop"] if importlib.util.find_spec("uvloop") else [])


@pytest.fixture(params=LOOPS)
def served(store: KVStore, spec: ModelSpec, request: pytest.FixtureRequest):
    """A live server with the fast path on, a model, and 8 stored tokens, on each event loop."""
    server = LiveServer(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES, event_loop=request.param))
    with KVStoreClient(server.url, shared_memory_bytes=0) as client:
        client.register_model("m", spec)
        client.store("m", list(range(8)), random_kv(spec, 8, seed=1))
    yield server
    server.close()


def _connect(server: LiveServer) -> Connection:
    host, port = server.url.removeprefix("http://").split(":")
    return Connection(host, int(port), timeout_s=10)


def _handed_to_aiohttp(server: LiveServer) -> int:
    return sum(lane.handed for lane in server.app[FAST_PATH].lanes.values())


@pytest.mark.parametrize("loop", LOOPS)
def test_clients_get_the_same_answers_with_and_without_it(tmp_path, spec: ModelSpec, loop: str):
    kv = random_kv(spec, 12, seed=3)
    answers = []
    for fast in (True, False):
        with KVStore(_store_config(tmp_path / str(fast))) as store:
            server = LiveServer(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES, fast_path=fast, event_loop=loop))
            try:
                with KVStoreClient(server.url) as shm, KVStoreClient(server.url, shared_memory_bytes=0) as tcp:
                    shm.register_model("m", spec)
                    stored = [shm.store("m", list(range(12)), kv), tcp.store("m", list(range(100, 112)), kv),
                              tcp.store_chunk("m", list(range(200, 208)), kv[:, :, :8])]
                    looked = [c.lookup("m", list(range(12)) + [7]) for c in (shm, tcp)]
                    fetched = [shm.fetch("m", list(range(12)), start=2), shm.fetch("m", list(range(12))),
                               tcp.fetch("m", list(range(100, 112)), start=5)]
                    answers.append((stored, looked, fetched))
                    if fast:  # these went past aiohttp: it saw the model PUT and the first fetches only
                        assert _handed_to_aiohttp(server) < 8
            finally:
                server.close()
    (s1, l1, f1), (s2, l2, f2) = answers
    assert s1 == s2 and l1 == l2
    assert [r.matched_tokens for r in f1] == [r.matched_tokens for r in f2] == [12, 12, 12]
    for a, b in zip(f1, f2):
        assert torch.equal(a.kv, b.kv)
    assert torch.equal(f1[0].kv, kv[:, :, 2:]) and torch.equal(f1[2].kv, kv[:, :, 5:])


def _metric(server: LiveServer, name: str, label: str) -> float:
    conn = _connect(server)
    _, _, body = conn.request(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n", [])
    lines = [line for line in bytes(body).decode().splitlines() if line.startswith(name + "{") and label in line]
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines)


def test_answered_requests_are_counted_in_metrics(served: LiveServer, spec: ModelSpec):
    before = _metric(served, "kvstore_http_requests_total", 'route="/v1/lookup"')
    with KVStoreClient(served.url, shared_memory_bytes=0) as client:
        for _ in range(5):
            assert client.lookup("m", list(range(8))).matched_tokens == 8
    assert _metric(served, "kvstore_http_requests_total", 'route="/v1/lookup",status="200"') == before + 5
    assert _metric(served, "kvstore_http_request_duration_seconds_count", 'route="/v1/lookup"') == before + 5


@pytest.mark.parametrize("body, headers, status, code", [
    (_pack({"model": "nope", "tokens": [1, 2]}), {}, 404, "model_not_found"),
    (b"\xc1\xc1", {}, 400, "invalid_request"),
    (_pack({"model": "m", "tokens": [1, -2]}), {}, 400, "invalid_tokens"),
    (_pack({"model": "m", "tokens": tokens_bin([1, -2])}), {}, 400, "invalid_tokens"),  # the store checks a bin's ids
    (_pack({"model": "m", "tokens": [1], "start": 5}), {}, 400, "invalid_start"),
    (_pack({"model": "m", "tokens": [1], "shm": {"offset": 0, "nbytes": 64}}), {}, 403, "shared_memory_refused"),
])
def test_bad_requests_get_the_same_errors(served: LiveServer, body: bytes, headers: dict, status: int, code: str):
    conn = _connect(served)
    conn.sock.sendall(_request("/v1/fetch", body, **headers))
    got, answer = _answer(conn)
    assert (got, answer["error"]["code"]) == (status, code)
    conn.sock.sendall(_request("/v1/lookup", _pack({"model": "m", "tokens": list(range(8))})))
    assert _answer(conn) == (200, {"matched_tokens": 8, "tiers": {"cpu": 8}})  # the connection goes on


def test_a_known_head_with_a_body_of_another_length_is_aiohttps(served: LiveServer):
    conn = _connect(served)
    body = _pack({"model": "m", "tokens": list(range(8))})
    conn.sock.sendall(_request("/v1/lookup", body))
    assert _answer(conn) == (200, {"matched_tokens": 8, "tiers": {"cpu": 8}})  # its head is now known
    head = _request("/v1/lookup", body)[:-len(body)]
    handed = _handed_to_aiohttp(served)
    conn.sock.sendall(head + body[:-1])  # a byte short: aiohttp waits for it...
    time.sleep(0.05)
    conn.sock.sendall(body[-1:] + _request("/v1/lookup", body))  # ...gets it, and the next request with it
    assert _answer(conn) == (200, {"matched_tokens": 8, "tiers": {"cpu": 8}})
    assert _answer(conn) == (200, {"matched_tokens": 8, "tiers": {"cpu": 8}})
    assert _handed_to_aiohttp(served) == handed + 2


def test_json_and_unusual_requests_are_aiohttps(served: LiveServer):
    conn = _connect(served)
    body = _pack({"model": "m", "tokens": list(range(8))})
    conn.sock.sendall(_request("/v1/lookup", body, Accept="application/json"))
    assert _answer(conn) == (200, {"matched_tokens": 8, "tiers": {"cpu": 8}})  # JSON, decoded as such
    conn.sock.sendall(_request("/v1/lookup?x=1", body))
    assert _answer(conn)[0] == 200
    conn.sock.sendall(_request("/v1/lookup", body).replace(b"Host: x", b"Bad Name: x"))
    assert _answer(conn)[0] == 400  # aiohttp's verdict on a header name that is not a token
    conn = _connect(served)
    conn.sock.sendall(_request("/v1/lookup", body, **{"X-Long": "x" * 9000}))
    assert _answer(conn)[0] == 400  # aiohttp's line limit
    conn = _connect(served)
    conn.sock.sendall(_request("/v1/lookup", body, Connection="close"))
    assert _answer(conn)[0] == 200
    assert conn.sock.recv(1) == b""  # closed, as asked


def test_pipelined_requests_are_answered_in_order(served: LiveServer, spec: ModelSpec):
    """A store aiohttp handles (its body is bigger than one read) followed at once by lookups the
    fast path could take: they must wait for the store and see its pages."""
    conn = _connect(served)
    kv = random_kv(spec, 4000, seed=2)  # ~500 KiB of body: several reads
    tokens = list(range(1000, 5000))
    store = _request("/v1/store", _pack({"model": "m", "tokens": tokens_bin(tokens), "kv": kv_bin(kv)}))
    lookup = _request("/v1/lookup", _pack({"model": "m", "tokens": tokens_bin(tokens)}))
    fetch = _request("/v1/fetch", _pack({"model": "m", "tokens": tokens_bin(tokens[:8]), "start": 4}))
    conn.sock.sendall(store + lookup + lookup + fetch)
    assert _answer(conn)[1]["stored_tokens"] == 4000
    assert _answer(conn)[1]["matched_tokens"] == 4000
    assert _answer(conn)[1]["matched_tokens"] == 4000
    status, answer = _answer(conn)
    assert status == 200 and answer["matched_tokens"] == 8 and bytes(answer["kv"]) == kv_bin(kv[:, :, 4:8])


def test_a_request_waits_for_the_one_answered_on_a_pool_thread(store: KVStore, spec: ModelSpec):
    """A lookup the fast path could answer on the loop arrives while a store of the same tokens is
    on a pool thread: it is answered after the store, and sees its pages."""
    server = LiveServer(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES, inline_copy_bytes=0))
    store_now = store.store

    def slow_store(*args, **kwargs):
        time.sleep(0.3)
        return store_now(*args, **kwargs)

    store.store = slow_store  # type: ignore[method-assign]
    try:
        conn = _connect(server)
        conn.sock.sendall(_request("/v1/models/m", _pack(spec.to_dict()), method="PUT"))
        assert _answer(conn)[0] == 201
        tokens = list(range(16))
        conn.sock.sendall(_request("/v1/store", _pack({"model": "m", "tokens": tokens,
                                                       "kv": kv_bin(random_kv(spec, 16))})))
        time.sleep(0.1)  # the store is on its pool thread now
        conn.sock.sendall(_request("/v1/lookup", _pack({"model": "m", "tokens": tokens})))
        assert _answer(conn)[1] == {"stored_tokens": 16, "new_pages": 4}
        assert _answer(conn)[1] == {"matched_tokens": 16, "tiers": {"cpu": 16}}
    finally:
        server.close()


def test_a_head_split_across_reads_is_left_to_aiohttp(served: LiveServer):
    conn = _connect(served)
    request = _request("/v1/lookup", _pack({"model": "m", "tokens": list(range(8))}))
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    conn.sock.sendall(request[:20])
    time.sleep(0.05)
    conn.sock.sendall(request[20:] + request)
    assert _answer(conn) == (200, {"matched_tokens": 8, "tiers": {"cpu": 8}})
    assert _answer(conn) == (200, {"matched_tokens": 8, "tiers": {"cpu": 8}})


def test_a_body_over_the_limit_is_refused_as_without_it(store: KVStore, spec: ModelSpec):
    store.register_model("m", spec)
    server = LiveServer(store, ServerConfig(max_body_bytes=1024))
    try:
        conn = _connect(server)
        conn.sock.sendall(_request("/v1/lookup", _pack({"model": "m", "tokens": list(range(1000, 1400))})))
        status, answer = _answer(conn)
        assert (status, answer["error"]["code"]) == (413, "payload_too_large")
    finally:
        server.close()


def test_clients_ride_out_aiohttps_keep_alive_closes(store: KVStore, spec: ModelSpec):
    """aiohttp closes a connection it has seen idle for its keep-alive timeout, though the fast
    path served it meanwhile: the client reconnects (and registers its shared memory again)."""
    server = LiveServer(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES), keepalive_timeout_s=0.2)
    kv = random_kv(spec, 8, seed=4)
    try:
        with KVStoreClient(server.url) as client:
            client.register_model("m", spec)
            client.store("m", list(range(8)), kv)
            assert client.fetch("m", list(range(8))).matched_tokens == 8  # learns the size: shm from now on
            began = time.monotonic()
            fetches = 0
            while time.monotonic() - began < 1.0:
                result = client.fetch("m", list(range(8)))
                assert result.matched_tokens == 8 and torch.equal(result.kv, kv)
                fetches += 1
                time.sleep(0.01)
            assert fetches > 20
        registrations = _metric(server, "kvstore_http_requests_total", 'route="/v1/shm"')
        assert registrations >= 3  # aiohttp did close the connection (at 0.2 s idle to it) and the client came back
    finally:
        server.close()


def test_auth_is_checked(store: KVStore, spec: ModelSpec, tmp_path):
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"secret-a": "a"}))
    server = LiveServer(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES, auth_file=str(auth)))
    try:
        with KVStoreClient(server.url, token="secret-a") as client:
            client.register_model("m", spec)
            client.store("m", list(range(8)), random_kv(spec, 8))
            assert client.lookup("m", list(range(8))).matched_tokens == 8
        conn = _connect(server)
        body = _pack({"model": "m", "tokens": list(range(8))})
        for _ in range(2):  # the second time, the good head is one the fast path has taken before
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret-a"}):
                conn.sock.sendall(_request("/v1/lookup", body, **headers))
                status, answer = _answer(conn)
                assert (status, answer["error"]["code"]) == (401, "unauthorized")
            conn.sock.sendall(_request("/v1/lookup", body, Authorization="Bearer secret-a"))
            assert _answer(conn) == (200, {"matched_tokens": 8, "tiers": {"cpu": 8}})
    finally:
        server.close()


def _store_config(path) -> StoreConfig:
    return StoreConfig(data_dir=str(path), cpu_bytes=16 << 20, disk_bytes=0)
