"""Python clients of the sidecar: `KVStoreClient` (sync, http.client) and `AsyncKVStoreClient`
(aiohttp). Same methods and result types as the in-process `KVStore`, so the decode loop takes
either through `KVCacheBackend`; errors are the same `KVStoreError` subclasses; a server that
cannot be reached (refused, reset, timed out) is `BackendUnavailable`.

The sync client keeps persistent connections (a small pool, so one client is thread-safe),
disables Nagle (a request is a header send plus a body send), sends a store's KV straight from
the tensor's memory and reads a fetch's answer into one preallocated buffer that the returned
tensor views. The tenant is the server's business (bearer token), not a per-call argument.
"""
from __future__ import annotations

import asyncio
import http.client
import socket
import threading
from typing import Any, Sequence
from urllib.parse import urlsplit

import aiohttp

from api import client_codec as codec
from api.body import read_exact
from kvstore.config import ModelSpec
from kvstore.errors import BackendUnavailable, InvalidRequest
from kvstore.results import BlendResult, FetchResult, LookupResult, StoreResult

DEFAULT_URL = "http://127.0.0.1:8100"
_BLEND_NOTE = "comes with the CacheBlend routes (/v1/chunks/store, /v1/blend)"


class _Connection(http.client.HTTPConnection):
    """An HTTP/1.1 connection with Nagle off and socket buffers sized for multi-MiB values."""

    socket_buffer_bytes = 0

    def connect(self) -> None:
        super().connect()
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.socket_buffer_bytes:
            self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, self.socket_buffer_bytes)
        self.served = 0


class KVStoreClient:
    def __init__(self, url: str = DEFAULT_URL, *, token: str | None = None, timeout_s: float = 30.0,
                 socket_buffer_bytes: int = 4 << 20):
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"url: expected http://host:port, got {url!r}")
        self.url = url.rstrip("/")
        self._host, self._port = parts.hostname, parts.port or 80
        self._timeout_s = timeout_s
        self._socket_buffer_bytes = socket_buffer_bytes
        self._headers = dict(codec.HEADERS, **({"Authorization": f"Bearer {token}"} if token else {}))
        self._idle: list[_Connection] = []
        self._lock = threading.Lock()

    # ---- the KVStore surface ----------------------------------------------------------------

    def register_model(self, model: str, spec: ModelSpec, *, tenant: str | None = None) -> ModelSpec:
        codec.check_tenant(tenant)
        return codec.spec_result(self._call("PUT", codec.model_path(model), [codec.spec_body(spec)]))

    def get_spec(self, model: str, *, tenant: str | None = None) -> ModelSpec:
        codec.check_tenant(tenant)
        return codec.spec_result(self._call("GET", codec.model_path(model)))

    def drop_model(self, model: str, *, tenant: str | None = None) -> int:
        codec.check_tenant(tenant)
        return self._call("DELETE", codec.model_path(model))["dropped_pages"]

    def lookup(self, model: str, tokens: Sequence[int], *, tenant: str | None = None) -> LookupResult:
        codec.check_tenant(tenant)
        return codec.lookup_result(self._call("POST", "/v1/lookup", [codec.tokens_body(model, tokens)]))

    def fetch(self, model: str, tokens: Sequence[int], *, start: int = 0, tenant: str | None = None,
              device: str = "cpu") -> FetchResult:
        codec.check_tenant(tenant)
        return codec.fetch_result(self._call("POST", "/v1/fetch", [codec.tokens_body(model, tokens, start)]), device)

    def store(self, model: str, tokens: Sequence[int], kv: Any, *, start: int = 0,
              tenant: str | None = None) -> StoreResult:
        codec.check_tenant(tenant)
        return codec.store_result(self._call("POST", "/v1/store", codec.store_parts(model, tokens, kv, start)))

    def store_chunk(self, model: str, tokens: Sequence[int], kv: Any, *, tenant: str | None = None) -> StoreResult:
        raise NotImplementedError(f"store_chunk {_BLEND_NOTE}")

    def blend(self, model: str, chunks: Sequence[Sequence[int]], *, start_pos: int = 0,
              tenant: str | None = None) -> BlendResult:
        raise NotImplementedError(f"blend {_BLEND_NOTE}")

    def stats(self) -> dict[str, Any]:
        return self._call("GET", "/v1/stats")

    def healthz(self) -> bool:
        return self._call("GET", "/healthz").get("status") == "ok"

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
        for conn in idle:
            conn.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- transport --------------------------------------------------------------------------

    def _call(self, method: str, path: str, parts: codec.Parts | None = None) -> Any:
        conn = self._take()
        try:
            try:
                status, ctype, body = self._roundtrip(conn, method, path, parts)
            except (ConnectionError, http.client.BadStatusLine) as exc:
                # A kept-alive connection the server has since closed: retry once on a fresh one
                # (every route is idempotent: storing the same pages again changes nothing).
                conn.close()
                if not conn.served or isinstance(exc, ConnectionRefusedError):
                    raise
                conn = self._new()
                status, ctype, body = self._roundtrip(conn, method, path, parts)
        except (OSError, http.client.HTTPException) as exc:  # timeouts, refused, reset, garbled
            conn.close()
            raise BackendUnavailable(f"{self.url}: {method} {path}: {type(exc).__name__}: {exc}") from exc
        self._give(conn)
        return codec.decode(status, ctype, body)

    def _roundtrip(self, conn: _Connection, method: str, path: str,
                   parts: codec.Parts | None) -> tuple[int, str, bytearray]:
        parts = parts or []
        conn.putrequest(method, path, skip_accept_encoding=True)
        for name, value in self._headers.items():
            conn.putheader(name, value)
        conn.putheader("Content-Length", str(sum(memoryview(p).nbytes for p in parts)))
        conn.endheaders(parts[0] if parts else None)
        for part in parts[1:]:
            conn.send(part)  # the tensor's own memory: sendall, no copy
        resp = conn.getresponse()
        body = _read_body(resp)
        conn.served += 1
        if resp.will_close:
            conn.close()
        return resp.status, resp.getheader("Content-Type", ""), body

    def _take(self) -> _Connection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._new()

    def _new(self) -> _Connection:
        conn = _Connection(self._host, self._port, timeout=self._timeout_s)
        conn.socket_buffer_bytes = self._socket_buffer_bytes
        conn.served = 0
        return conn

    def _give(self, conn: _Connection) -> None:
        if conn.sock is None:
            return
        with self._lock:
            self._idle.append(conn)


def _read_body(resp: http.client.HTTPResponse) -> bytearray:
    if resp.length is None:  # chunked or close-delimited: rare (we never send those)
        return bytearray(resp.read())
    buf = bytearray(resp.length)
    view = memoryview(buf)
    got = 0
    while got < len(buf):
        n = resp.readinto(view[got:])
        if not n:
            raise http.client.IncompleteRead(bytes(buf[:got]), len(buf) - got)
        got += n
    return buf


class AsyncKVStoreClient:
    """The asyncio twin of `KVStoreClient`, on one aiohttp session (pooled, keep-alive)."""

    def __init__(self, url: str = DEFAULT_URL, *, token: str | None = None, timeout_s: float = 30.0,
                 max_connections: int = 64):
        self.url = url.rstrip("/")
        self._timeout = aiohttp.ClientTimeout(total=timeout_s)
        self._headers = dict(codec.HEADERS, **({"Authorization": f"Bearer {token}"} if token else {}))
        self._max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    async def register_model(self, model: str, spec: ModelSpec, *, tenant: str | None = None) -> ModelSpec:
        codec.check_tenant(tenant)
        return codec.spec_result(await self._call("PUT", codec.model_path(model), [codec.spec_body(spec)]))

    async def get_spec(self, model: str, *, tenant: str | None = None) -> ModelSpec:
        codec.check_tenant(tenant)
        return codec.spec_result(await self._call("GET", codec.model_path(model)))

    async def drop_model(self, model: str, *, tenant: str | None = None) -> int:
        codec.check_tenant(tenant)
        return (await self._call("DELETE", codec.model_path(model)))["dropped_pages"]

    async def lookup(self, model: str, tokens: Sequence[int], *, tenant: str | None = None) -> LookupResult:
        codec.check_tenant(tenant)
        return codec.lookup_result(await self._call("POST", "/v1/lookup", [codec.tokens_body(model, tokens)]))

    async def fetch(self, model: str, tokens: Sequence[int], *, start: int = 0, tenant: str | None = None,
                    device: str = "cpu") -> FetchResult:
        codec.check_tenant(tenant)
        obj = await self._call("POST", "/v1/fetch", [codec.tokens_body(model, tokens, start)])
        return codec.fetch_result(obj, device)

    async def store(self, model: str, tokens: Sequence[int], kv: Any, *, start: int = 0,
                    tenant: str | None = None) -> StoreResult:
        codec.check_tenant(tenant)
        return codec.store_result(await self._call("POST", "/v1/store", codec.store_parts(model, tokens, kv, start)))

    async def store_chunk(self, model: str, tokens: Sequence[int], kv: Any, *,
                          tenant: str | None = None) -> StoreResult:
        raise NotImplementedError(f"store_chunk {_BLEND_NOTE}")

    async def blend(self, model: str, chunks: Sequence[Sequence[int]], *, start_pos: int = 0,
                    tenant: str | None = None) -> BlendResult:
        raise NotImplementedError(f"blend {_BLEND_NOTE}")

    async def stats(self) -> dict[str, Any]:
        return await self._call("GET", "/v1/stats")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "AsyncKVStoreClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    async def _call(self, method: str, path: str, parts: codec.Parts | None = None) -> Any:
        if self._session is None:
            self._session = aiohttp.ClientSession(
                timeout=self._timeout, connector=aiohttp.TCPConnector(limit=self._max_connections))
        # aiohttp has no scatter send: join the parts (one copy of kv, the price of this client).
        data = b"".join(parts) if parts else None
        try:
            async with self._session.request(method, self.url + path, data=data, headers=self._headers) as resp:
                length = resp.content_length
                body = await read_exact(resp.content, length) if length is not None else bytearray(await resp.read())
                status, ctype = resp.status, resp.content_type
        except (aiohttp.ClientError, asyncio.TimeoutError, InvalidRequest) as exc:  # InvalidRequest: body cut short
            raise BackendUnavailable(f"{self.url}: {method} {path}: {type(exc).__name__}: {exc}") from exc
        return codec.decode(status, ctype, body)
