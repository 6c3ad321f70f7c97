"""Helpers of the sidecar tests: msgpack calls through aiohttp's test client to the sidecar served
as `kvstore serve` serves it (`SidecarTestServer`), KV bytes, and a live server on a real socket
in a thread of its own (for the sync client, which must not block the test's loop)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from typing import Any

import msgpack
import torch
from aiohttp.test_utils import BaseTestServer, TestClient
from yarl import URL
from kv_tensors import random_kv as random_kv  # the sidecar tests take it from here

from kvstore.api.server.config import ServerConfig
from kvstore.api.server.event_loop import loop_factory
from kvstore.api.server.serve import listen_socket, serve_app
from kvstore import KVStore

MAX_BODY_BYTES = 1 << 20
MSGPACK = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}


def kv_bin(kv: torch.Tensor) -> bytes:
    return kv.contiguous().view(-1).view(torch.uint8).numpy().tobytes()


def tokens_bin(tokens: list[int]) -> bytes:
    return torch.tensor(tokens, dtype=torch.int32).numpy().astype("<i4").tobytes()


async def call(http: TestClient, method: str, path: str, body: Any = None, *,
               raw: bytes | None = None, headers: dict[str, str] | None = None) -> tuple[int, Any]:
    """Send `body` as msgpack (or `raw` bytes as they are); decode the answer by its type."""
    data = raw if raw is not None else (msgpack.packb(body, use_bin_type=True) if body is not None else None)
    resp = await http.request(method, path, data=data, headers=headers if headers is not None else MSGPACK)
    payload = await resp.read()
    if resp.content_type == "application/json":
        return resp.status, json.loads(payload)
    if resp.content_type == "application/msgpack":
        return resp.status, msgpack.unpackb(payload, raw=False)
    return resp.status, payload.decode()


class SidecarTestServer(BaseTestServer):
    """aiohttp's test server, serving the sidecar through api/server/serve.py `serve_app` (the data plane
    reads every connection; aiohttp serves the admin routes) on the test's own loop."""

    def __init__(self, store: KVStore, config: ServerConfig, **kwargs: Any):
        super().__init__(**kwargs)
        self._store, self._config = store, config
        self._served: Any = None
        self.app: Any = None

    async def start_server(self, loop: Any = None, **kwargs: Any) -> None:
        if self._served is not None:
            return
        sock = listen_socket(dataclasses.replace(self._config, host="127.0.0.1", port=0))
        self._served = await serve_app(self._store, self._config, sock)
        self.runner, self.app = self._served.runner, self._served.app
        self.host, self.port = sock.getsockname()[:2]
        self.scheme = "http"
        self._root = URL(self._served.url)

    async def _make_runner(self, **kwargs: Any) -> Any:
        raise AssertionError("unused: start_server serves the app")

    async def close(self) -> None:
        if self._served is not None and not self.closed:
            await self._served.close()
            self._served.sock.close()
            self._root = None
            self._closed = True


def sidecar_client(store: KVStore, config: ServerConfig) -> TestClient:
    """`async with sidecar_client(store, config) as http:` aiohttp's test client of a sidecar."""
    return TestClient(SidecarTestServer(store, config))


class LiveServer:
    """The app on a real socket, served by an event loop in a background thread, as `kvstore serve`
    serves it (api/server/serve.py `serve_app`: the connection limit, the data plane), on the event
    loop the config names (uvloop when installed, by default)."""

    def __init__(self, store: KVStore, config: ServerConfig, *, keepalive_timeout_s: float = 75.0):
        self._loop = loop_factory(config.event_loop)()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._thread.start()
        self._sock = listen_socket(dataclasses.replace(config, host="127.0.0.1", port=0))
        self._served = self._call(serve_app(store, config, self._sock, keepalive_timeout_s=keepalive_timeout_s))
        self.app = self._served.app
        self.url = self._served.url

    def _call(self, coro: Any) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(30)

    def close(self) -> None:
        self._call(self._served.close())
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        self._loop.close()
        self._sock.close()
