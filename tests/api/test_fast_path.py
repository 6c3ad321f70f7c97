"""The data plane (api/server/fast_path.py) against a live server: it reads every request of every
connection and answers every data request itself, whatever its framing (one read or many,
Content-Length or chunked, msgpack or JSON, pipelined behind admin requests); aiohttp sees only
the admin routes; answers keep request order; errors, limits, auth and metrics are as they were."""
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
from kvstore.api.server.config import ServerConfig
from kvstore.api.client.http1 import Connection
from kvstore import KVStore, ModelSpec, StoreConfig

LOOKUP_8 = (200, {"matched_tokens": 8, "tiers": {"cpu": 8}})


def _request(path: str, body: bytes, method: str = "POST", **headers: str) -> bytes:
    """`headers`: Content_Type=... for Content-Type; None drops a header."""
    fields = {"Host": "x", "Content-Type": "application/msgpack", "Content-Length": str(len(body)),
              **{k.replace("_", "-"): v for k, v in headers.items()}}
    fields = {k: v for k, v in fields.items() if v is not None}
    head = f"{method} {path} HTTP/1.1\r\n" + "".join(f"{k}: {v}\r\n" for k, v in fields.items()) + "\r\n"
    return head.encode() + body


def _chunked(path: str, body: bytes, step: int = 7) -> bytes:
    chunks = b"".join(b"%x\r\n%s\r\n" % (len(body[i:i + step]), body[i:i + step]) for i in range(0, len(body), step))
    return _request(path, b"", Content_Length=None, Transfer_Encoding="chunked") + chunks + b"0\r\n\r\n"


def _answer(conn: Connection) -> tuple[int, Any]:
    """Read one answer off the connection: (status, decoded body)."""
    status, headers = conn._read_head()
    body = bytes(conn._read_exact(int(headers["content-length"])))
    ctype = headers.get("content-type", "")
    if ctype.startswith("application/json"):
        return status, json.loads(body)
    if ctype.startswith("application/msgpack"):
        return status, msgpack.unpackb(body, raw=False)
    return status, {"text": body}  # plain text: what cannot be framed


def _pack(obj: dict) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def _closed(conn: Connection) -> bool:
    conn.sock.settimeout(5)
    return conn.sock.recv(1) == b""


# The data plane only uses asyncio's transport and protocol interfaces: it must behave the same
# on both loops `kvstore serve` may run (api/server/event_loop.py).
LOOPS = ["asyncio"] + (["uvloop"] if importlib.util.find_spec("uvloop") else [])


@pytest.fixture(params=LOOPS)
def served(store: KVStore, spec: ModelSpec, request: pytest.FixtureRequest):
    """A live server, a model, and 8 stored tokens, on each event loop."""
    server = LiveServer(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES, event_loop=request.param))
    with KVStoreClient(server.url, shared_memory_bytes=0) as client:
        client.register_model("m", spec)
        client.store("m", list(range(8)), random_kv(spec, 8, seed=1))
    yield server
    server.close()


def _connect(server: LiveServer) -> Connection:
    host, port = server.url.removeprefix("http://").split(":")
    return Connection(host, int(port), timeout_s=10)


def _aiohttp_requests(server: LiveServer) -> int:
    """Requests aiohttp has handled: only admin requests ever reach it."""
    return server._served.runner.server.requests_count


@pytest.mark.parametrize("loop", LOOPS)
def test_clients_get_what_the_store_in_process_gives(tmp_path, spec: ModelSpec, loop: str):
    kv = random_kv(spec, 12, seed=3)
    with KVStore(_store_config(tmp_path / "served")) as store:
        server = LiveServer(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES, event_loop=loop))
        try:
            with KVStoreClient(server.url) as shm, KVStoreClient(server.url, shared_memory_bytes=0) as tcp:
                shm.register_model("m", spec)
                admin = _aiohttp_requests(server)
                assert admin >= 1  # the model's registration: aiohttp's
                stored = [shm.store("m", list(range(12)), kv), tcp.store("m", list(range(100, 112)), kv),
                          tcp.store_chunk("m", list(range(200, 208)), kv[:, :, :8])]
                looked = [c.lookup("m", list(range(12)) + [7]) for c in (shm, tcp)]
                fetched = [shm.fetch("m", list(range(12)), start=2), shm.fetch("m", list(range(12))),
                           tcp.fetch("m", list(range(100, 112)), start=5)]
                assert _aiohttp_requests(server) == admin  # every data request, shm's too, was the data plane's
        finally:
            server.close()
    with KVStore(_store_config(tmp_path / "embedded")) as store:
        store.register_model("m", spec)
        assert stored == [store.store("m", list(range(12)), kv), store.store("m", list(range(100, 112)), kv),
                          store.store_chunk("m", list(range(200, 208)), kv[:, :, :8])]
        assert looked == [store.lookup("m", list(range(12)) + [7])] * 2
    assert [r.matched_tokens for r in fetched] == [12, 12, 12]
    assert torch.equal(fetched[0].kv, kv[:, :, 2:]) and torch.equal(fetched[1].kv, kv)
    assert torch.equal(fetched[2].kv, kv[:, :, 5:])


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
    conn = _connect(served)
    conn.sock.sendall(_request("/v1/lookup", b"", method="GET", Content_Length=None))
    assert _answer(conn)[0] == 405
    assert _metric(served, "kvstore_http_requests_total", 'method="GET",route="unmatched",status="405"') == 1


@pytest.mark.parametrize("body, headers, status, code", [
    (_pack({"model": "nope", "tokens": [1, 2]}), {}, 404, "model_not_found"),
    (b"\xc1\xc1", {}, 400, "invalid_request"),
    (_pack({"model": "m", "tokens": [1, -2]}), {}, 400, "invalid_tokens"),
    (_pack({"model": "m", "tokens": tokens_bin([1, -2])}), {}, 400, "invalid_tokens"),  # the store checks a bin's ids
    (_pack({"model": "m", "tokens": [1], "start": 5}), {}, 400, "invalid_start"),
    (_pack({"model": "m", "tokens": [1], "shm": {"offset": 0, "nbytes": 64}}), {}, 403, "shared_memory_refused"),
    (_pack({"model": "m", "tokens": [1]}), {"Content_Type": "text/plain"}, 415, "unsupported_media_type"),
    (_pack({"model": "m", "tokens": [1]}), {"Content_Encoding": "gzip"}, 400, "invalid_request"),
])
def test_bad_requests_get_the_same_errors(served: LiveServer, body: bytes, headers: dict, status: int, code: str):
    conn = _connect(served)
    conn.sock.sendall(_request("/v1/fetch", body, **headers))
    got, answer = _answer(conn)
    assert (got, answer["error"]["code"]) == (status, code)
    conn.sock.sendall(_request("/v1/lookup", _pack({"model": "m", "tokens": list(range(8))})))
    assert _answer(conn) == LOOKUP_8  # the connection goes on


def test_a_body_over_several_reads_is_read_whole(served: LiveServer):
    conn = _connect(served)
    conn.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    body = _pack({"model": "m", "tokens": list(range(8))})
    conn.sock.sendall(_request("/v1/lookup", body))
    assert _answer(conn) == LOOKUP_8  # its head is now known
    head = _request("/v1/lookup", body)[:-len(body)]
    for split in (head[:20], head[20:] + body[:-1]):  # the head in two reads, the body a byte short...
        conn.sock.sendall(split)
        time.sleep(0.05)
    conn.sock.sendall(body[-1:] + _request("/v1/lookup", body))  # ...its last byte, and the next request with it
    assert _answer(conn) == LOOKUP_8
    assert _answer(conn) == LOOKUP_8


def test_json_chunked_and_unusual_requests_are_answered_here(served: LiveServer):
    admin = _aiohttp_requests(served)
    conn = _connect(served)
    conn.sock.sendall(_request("/healthz", b"", method="GET", Content_Length=None, Content_Type=None))
    assert _answer(conn) == (200, {"status": "ok"}) and _aiohttp_requests(served) == admin + 1
    body = _pack({"model": "m", "tokens": list(range(8))})
    conn.sock.sendall(_request("/v1/lookup", body, Accept="application/json"))
    assert _answer(conn) == LOOKUP_8  # JSON, decoded as such
    as_json = json.dumps({"model": "m", "tokens": list(range(8))}).encode()
    conn.sock.sendall(_request("/v1/lookup", as_json, Content_Type="application/json"))
    assert _answer(conn) == LOOKUP_8
    conn.sock.sendall(_request("/v1/lookup?x=1", body) + _request("http://x/v1/look%75p", body))
    assert _answer(conn) == LOOKUP_8 and _answer(conn) == LOOKUP_8
    conn.sock.sendall(_chunked("/v1/lookup", body) + _request("/v1/lookup", body, Expect="100-continue"))
    assert _answer(conn) == LOOKUP_8
    status, headers = conn._read_head()
    assert status == 100 and _answer(conn) == LOOKUP_8
    conn.sock.sendall(_request("/v1/lookup", body, Expect="something") + _request("/v1/lookup", body))
    assert _answer(conn) == (417, {"text": b"Unknown Expect: something"})
    assert _answer(conn) == LOOKUP_8  # the refused request's body was skipped
    assert _aiohttp_requests(served) == admin + 1  # none of them reached aiohttp
    conn.sock.sendall(_request("/v1/lookup", body, Connection="close"))
    assert _answer(conn) == LOOKUP_8
    assert _closed(conn)  # as asked
    conn = _connect(served)
    conn.sock.sendall(_request("/v1/lookup", body).replace(b"HTTP/1.1", b"HTTP/1.0"))
    assert _answer(conn) == LOOKUP_8
    assert _closed(conn)  # HTTP/1.0 without keep-alive


@pytest.mark.parametrize("request_bytes", [
    _request("/v1/lookup", b"{}").replace(b"Host: x", b"Bad Name: x"),  # a header name that is not a token
    _request("/v1/lookup", b"{}", X_Long="x" * 9000),  # past aiohttp's line limit
    _request("/v1/lookup", b"{}", Transfer_Encoding="chunked"),  # and a Content-Length
    _request("/v1/lookup", b"{}").replace(b"\r\n", b"\n"),  # bare LF line ends
    _request("/v1/lookup", b"{}", method="post"),
    b"HELLO\r\n\r\n",
], ids=["bad-name", "long-line", "chunked-and-length", "bare-lf", "lowercase-method", "no-request-line"])
def test_what_cannot_be_framed_is_400_and_closes(served: LiveServer, request_bytes: bytes):
    conn = _connect(served)
    conn.sock.sendall(request_bytes)
    status, answer = _answer(conn)
    assert status == 400 and b"Bad Request" in answer["text"]
    assert _closed(conn)


def test_pipelined_requests_are_answered_in_order(served: LiveServer, spec: ModelSpec):
    """A store whose body is bigger than one read, an admin request, lookups and a fetch, in one
    send: each waits for the one before it and sees its pages."""
    conn = _connect(served)
    kv = random_kv(spec, 4000, seed=2)  # ~500 KiB of body: several reads
    tokens = list(range(1000, 5000))
    store = _request("/v1/store", _pack({"model": "m", "tokens": tokens_bin(tokens), "kv": kv_bin(kv)}))
    lookup = _request("/v1/lookup", _pack({"model": "m", "tokens": tokens_bin(tokens)}))
    fetch = _request("/v1/fetch", _pack({"model": "m", "tokens": tokens_bin(tokens[:8]), "start": 4}))
    stats = _request("/v1/stats", b"", method="GET", Content_Length=None, Content_Type=None)
    spec_put = _chunked("/v1/models/m", _pack(spec.to_dict())).replace(b"POST", b"PUT", 1)
    conn.sock.sendall(store + stats + lookup + spec_put + lookup + fetch)
    assert _answer(conn)[1]["stored_tokens"] == 4000
    status, answer = _answer(conn)
    assert status == 200 and answer["tiers"]["cpu"]["pages"] >= 1000  # aiohttp's answer, after the store's
    assert _answer(conn)[1]["matched_tokens"] == 4000
    assert _answer(conn) == (200, spec.to_dict())  # a chunked admin body, handed to aiohttp whole
    assert _answer(conn)[1]["matched_tokens"] == 4000
    status, answer = _answer(conn)
    assert status == 200 and answer["matched_tokens"] == 8 and bytes(answer["kv"]) == kv_bin(kv[:, :, 4:8])


def test_a_request_waits_for_the_one_answered_on_a_pool_thread(store: KVStore, spec: ModelSpec):
    """A lookup the data plane could answer on the loop arrives while a store of the same tokens
    is on a pool thread: it is answered after the store, and sees its pages."""
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


def test_shutdown_answers_the_requests_under_way(store: KVStore, spec: ModelSpec):
    server = LiveServer(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES, inline_copy_bytes=0))
    store.register_model("m", spec)
    store_now = store.store

    def slow_store(*args, **kwargs):
        time.sleep(0.3)
        return store_now(*args, **kwargs)

    store.store = slow_store  # type: ignore[method-assign]
    conn = _connect(server)
    conn.sock.sendall(_request("/v1/store", _pack({"model": "m", "tokens": list(range(8)),
                                                   "kv": kv_bin(random_kv(spec, 8))})))
    time.sleep(0.1)  # on its pool thread
    server.close()
    assert _answer(conn) == (200, {"stored_tokens": 8, "new_pages": 2})
    assert _closed(conn)


def test_a_body_over_the_limit_is_refused(store: KVStore, spec: ModelSpec):
    store.register_model("m", spec)
    server = LiveServer(store, ServerConfig(max_body_bytes=1024))
    try:
        for request in (_request("/v1/lookup", _pack({"model": "m", "tokens": list(range(1000, 1400))})),
                        _chunked("/v1/lookup", _pack({"model": "m", "tokens": list(range(1000, 1400))}), 100)):
            conn = _connect(server)
            conn.sock.sendall(request)
            status, answer = _answer(conn)
            assert (status, answer["error"]["code"]) == (413, "payload_too_large")
            assert _closed(conn)  # the rest of the body is not read
    finally:
        server.close()


def test_a_body_that_does_not_arrive_in_time_is_408(store: KVStore, spec: ModelSpec):
    store.register_model("m", spec)
    server = LiveServer(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES, body_timeout_s=0.3))
    try:
        conn = _connect(server)
        request = _request("/v1/lookup", _pack({"model": "m", "tokens": list(range(8))}))
        began = time.monotonic()
        conn.sock.sendall(request[:-3])
        status, answer = _answer(conn)
        assert (status, answer["error"]["code"]) == (408, "request_timeout") and "body" in answer["error"]["message"]
        assert 0.25 < time.monotonic() - began < 5
        assert _closed(conn)
    finally:
        server.close()


def test_a_connection_in_use_stays_open_and_an_idle_one_is_closed(store: KVStore, spec: ModelSpec):
    """Keep-alive is the data plane's: a connection serving requests is never closed under its
    client, whichever server answered them; one idle for the timeout is."""
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
        assert _metric(server, "kvstore_http_requests_total", 'route="/v1/shm"') == 1  # one connection throughout
        conn = _connect(server)
        began = time.monotonic()
        assert _closed(conn)
        assert 0.1 < time.monotonic() - began < 5
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
        for _ in range(2):  # the second time, the good head is one the data plane has taken before
            for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "secret-a"}):
                conn.sock.sendall(_request("/v1/lookup", body, **headers))
                status, answer = _answer(conn)
                assert (status, answer["error"]["code"]) == (401, "unauthorized")
            conn.sock.sendall(_request("/v1/lookup", body, Authorization="Bearer secret-a"))
            assert _answer(conn) == LOOKUP_8
    finally:
        server.close()


def _store_config(path) -> StoreConfig:
    return StoreConfig(data_dir=str(path), cpu_bytes=16 << 20, disk_bytes=0)
