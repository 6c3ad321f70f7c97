"""Helpers of the sidecar tests: msgpack calls through the aiohttp test client, KV bytes, and
a live server on a real socket (for the sync client, which must not block the test's loop)."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import threading
from typing import Any

import msgpack
import torch
from aiohttp.test_utils import TestClient
from kv_tensors import random_kv as random_kv  # the sidecar tests take it from here

from kvstore.api.config import ServerConfig
from kvstore.api.event_loop import loop_factory
from kvstore.api.server import listen_socket, serve_app
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


class LiveServer:
    """The app on a real socket, served by an event loop in a background thread, as `kvstore serve`
    serves it (api/server.py `serve_app`: connection limit, and the fast path unless the config
    turns it off), on the event loop the config names (uvloop when installed, by default)."""

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
