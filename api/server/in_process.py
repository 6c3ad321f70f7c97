"""A sidecar inside this process: the real app on a loopback port, served from a thread.

`kvstore demo` and `bench/ttft.py` use it when no `--server` is given, and so does the vLLM
connector's loopback sidecar, so the decode loop still goes through HTTP and `KVStoreClient`,
exactly as it would against `kvstore serve`: it is served by the same function
(serve.py `serve_app`: the connection limit, the fast path). It is not a production server
(that is `kvstore serve`): no signals, no auth, one event loop thread.

It is the server's (api/server/), not the decode loop's: the decode loop, the connector and the
benches each start one and then talk to it as clients.
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
        from kvstore.api.server.event_loop import loop_factory

        self._loop = loop_factory("auto")()  # the loop `kvstore serve` runs on (uvloop when installed)
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True, name="kvstore-sidecar")
        self._served: Any = None
        self._store: Any = None
        self._sock: Any = None

    def __enter__(self) -> str:
        from kvstore.api.server.config import ServerConfig
        from kvstore.api.server.serve import listen_socket, serve_app
        from kvstore.store import KVStore

        config = ServerConfig(host="127.0.0.1", port=0)  # port 0: a free one, named by the socket
        self._sock = listen_socket(config)
        self._store = KVStore(self.store_config)
        self._thread.start()
        self._served = asyncio.run_coroutine_threadsafe(serve_app(self._store, config, self._sock),
                                                        self._loop).result(timeout=30)
        self.url = self._served.url
        return self.url

    @property
    def store(self) -> Any:
        """The `KVStore` it serves (None before `__enter__`): for a caller in this process that
        needs the store itself, e.g. the vLLM connector's KV events."""
        return self._store

    def __exit__(self, *exc: object) -> None:
        try:
            if self._served is not None:
                asyncio.run_coroutine_threadsafe(self._served.close(), self._loop).result(timeout=30)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(timeout=10)
            self._loop.close()
            if self._sock is not None:
                self._sock.close()
            if self._store is not None:
                self._store.close()
