"""A sidecar inside this process: the real aiohttp app on a loopback port, served from a thread.

`kvstore demo` and `bench/ttft.py` use it when no `--server` is given, so the decode loop still
goes through HTTP and `KVStoreClient`, exactly as it would against `kvstore serve`. It is not a
production server (that is `kvstore serve`): no signals, no auth, one event loop thread.
"""
from __future__ import annotations

import asyncio
import threading
from typing import Any

from kvstore.config import StoreConfig


class InProcessSidecar:
    """`with InProcessSidecar(StoreConfig(...)) as url:` -> "http://127.0.0.1:<port>"."""

    def __init__(self, store_config: StoreConfig):
        self.store_config = store_config
        self.url: str | None = None
        from kvstore.api.event_loop import loop_factory

        self._loop = loop_factory("auto")()  # the loop `kvstore serve` runs on (uvloop when installed)
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="kvstore-sidecar")
        self._runner: Any = None
        self._store: Any = None

    def __enter__(self) -> str:
        from aiohttp import web

        from kvstore.api.app import create_app
        from kvstore.api.config import ServerConfig
        from kvstore.store import KVStore

        self._store = KVStore(self.store_config)
        config = ServerConfig(host="127.0.0.1", port=0)

        async def start() -> int:
            self._runner = web.AppRunner(create_app(self._store, config), access_log=None)
            await self._runner.setup()
            await web.TCPSite(self._runner, config.host, 0).start()
            return self._runner.addresses[0][1]  # port 0: the runner knows which one was bound

        self._thread.start()
        port = asyncio.run_coroutine_threadsafe(start(), self._loop).result(timeout=30)
        self.url = f"http://127.0.0.1:{port}"
        return self.url

    def __exit__(self, *exc: object) -> None:
        try:
            if self._runner is not None:
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
            if self._store is not None:
                self._store.close()
