"""The HTTP sidecar (aiohttp app factory, wire format, server) and its Python clients.

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
