"""`SidecarState`: what every request of one app reaches, as one plain object.

The data plane (api/server/fast_path.py and the data routes' handlers, api/server/handlers.py) is handed this
instead of aiohttp's `web.Application`, so it needs nothing of aiohttp: a data request never
meets aiohttp's request machinery (tests/test_layers.py checks that no module of the data plane
imports aiohttp). The aiohttp app keeps the same objects under its keys (api/admin/context.py) for the
admin routes.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from kvstore.api.server.catch_up import CatchUp
from kvstore.api.server.config import ServerConfig
from kvstore.api.server.metrics import Metrics
from kvstore.api.server.shared_memory import SharedMemoryArenas


@dataclass(frozen=True, slots=True)
class SidecarState:
    store: Any  # the KVStore (Any: store.py imports torch and lmdb)
    loop_store: Any  # the same store as the event loop calls it (api/server/loop_store.py `LoopStore`)
    config: ServerConfig
    executor: ThreadPoolExecutor  # the app's pool: every blocking store call runs on it
    shared_memory: SharedMemoryArenas
    auth: dict[bytes, str]  # bearer token -> tenant; empty: no auth
    metrics: Metrics
    catch_up: CatchUp  # the eviction policy learns after each answer (api/server/catch_up.py)
