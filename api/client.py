"""Python clients of the sidecar: `KVStoreClient` (sync, own HTTP/1.1 connection) and `AsyncKVStoreClient`
(aiohttp). Same methods and result types as the in-process `KVStore`, so the decode loop takes
either through `KVCacheBackend`; errors are the same `KVStoreError` subclasses; a server that
cannot be reached (refused, reset, timed out) is `BackendUnavailable`.

The sync client keeps persistent connections (a small pool, so one client is thread-safe),
sends a request's head, fields and the tensor's own memory in one scatter-gather syscall and
reads a fetch's answer into one preallocated buffer that the returned tensor views (api/http1.py). The tenant is the server's business (bearer token), not a per-call argument.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any, Sequence
from urllib.parse import urlsplit

import aiohttp

from api import client_codec as codec
from api.body import read_exact
from api.http1 import Connection, ProtocolError
from kvstore.config import ModelSpec
from kvstore.errors import BackendUnavailable, InvalidRequest
from kvstore.results import BlendResult, FetchResult, LookupResult, StoreResult

DEFAULT_URL = "http://127.0.0.1:8100"


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
        headers = dict(codec.HEADERS, Host=f"{self._host}:{self._port}",
                       **({"Authorization": f"Bearer {token}"} if token else {}))
        self._head_lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._idle: list[Connection] = []
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
        codec.check_tenant(tenant)
        return codec.store_result(self._call("POST", "/v1/chunks/store", codec.store_parts(model, tokens, kv)))

    def blend(self, model: str, chunks: Sequence[Sequence[int]], *, start_pos: int = 0,
              tenant: str | None = None, device: str = "cpu") -> BlendResult:
        codec.check_tenant(tenant)
        return codec.blend_result(self._call("POST", "/v1/blend", [codec.blend_body(model, chunks, start_pos)]), device)

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
        parts = parts or []
        length = sum(memoryview(p).nbytes for p in parts)
        head = f"{method} {path} HTTP/1.1\r\n{self._head_lines}Content-Length: {length}\r\n\r\n".encode()
        conn = None
        try:
            conn = self._take()
            try:
                status, ctype, body = conn.request(head, parts)
            except (ConnectionError, ProtocolError):
                # A kept-alive connection the server has since closed: retry once on a fresh one
                # (every route is idempotent: storing the same pages again changes nothing).
                conn.close()
                if not conn.served:
                    raise
                conn = self._new()
                status, ctype, body = conn.request(head, parts)
        except OSError as exc:  # refused, reset, timed out, garbled
            if conn is not None:
                conn.close()
            raise BackendUnavailable(f"{self.url}: {method} {path}: {type(exc).__name__}: {exc}") from exc
        self._give(conn)
        return codec.decode(status, ctype, body)

    def _take(self) -> Connection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._new()

    def _new(self) -> Connection:
        return Connection(self._host, self._port, timeout_s=self._timeout_s,
                          socket_buffer_bytes=self._socket_buffer_bytes)

    def _give(self, conn: Connection) -> None:
        if conn.closed:
            return
        with self._lock:
            self._idle.append(conn)


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
        codec.check_tenant(tenant)
        return codec.store_result(await self._call("POST", "/v1/chunks/store", codec.store_parts(model, tokens, kv)))

    async def blend(self, model: str, chunks: Sequence[Sequence[int]], *, start_pos: int = 0,
                    tenant: str | None = None, device: str = "cpu") -> BlendResult:
        codec.check_tenant(tenant)
        obj = await self._call("POST", "/v1/blend", [codec.blend_body(model, chunks, start_pos)])
        return codec.blend_result(obj, device)

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
