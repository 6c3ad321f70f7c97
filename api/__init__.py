"""The HTTP sidecar and its Python clients, one sub-package per role:

    server/   the data plane (every connection read, the data routes answered), what one app's
              requests share, and serving it (`kvstore serve`, `InProcessSidecar`)
    admin/    aiohttp's app of the admin routes (`create_app`)
    client/   `KVStoreClient`, `AsyncKVStoreClient`
    proxy/    `kvstore proxy`, in front of vLLM engines
    protocol.py, framing.py, nesting.py: what the server and the client share

    from kvstore.api import create_app, KVStoreClient, AsyncKVStoreClient

Imports are lazy so that `kvstore.api.server.config` and `kvstore.api.client` load without the server's dependencies.
"""
from __future__ import annotations

from typing import Any

__all__ = ["create_app", "ServerConfig", "KVStoreClient", "AsyncKVStoreClient"]


def __getattr__(name: str) -> Any:
    if name == "create_app":
        from kvstore.api.admin.app import create_app

        return create_app
    if name == "ServerConfig":
        from kvstore.api.server.config import ServerConfig

        return ServerConfig
    if name in ("KVStoreClient", "AsyncKVStoreClient"):
        from kvstore.api import client

        return getattr(client, name)
    raise AttributeError(name)
