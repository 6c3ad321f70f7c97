"""What an admin handler reaches through its aiohttp request: the app's parts, by typed key.

Typed `AppKey`s instead of string keys, so a handler's `request.app[STORE]` is a `KVStore` to the
type checker. Every key holds the same object as the app's `SidecarState` (api/server/state.py), which
is what the data plane is handed instead of the aiohttp app. `run_blocking` is the one way the
admin handlers leave the event loop.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from aiohttp import web

from kvstore.api.server.catch_up import CatchUp
from kvstore.api.server.config import ServerConfig
from kvstore.api.server.fast_path import FastPath
from kvstore.api.server.metrics import Metrics
from kvstore.api.server.shared_memory import SharedMemoryArenas
from kvstore.api.server.state import SidecarState

T = TypeVar("T")

STATE: web.AppKey[SidecarState] = web.AppKey("state", SidecarState)
STORE: web.AppKey[Any] = web.AppKey("store", object)  # a KVStore (kept Any: store.py imports torch, lmdb)
# The same store as the event loop calls it (api/server/loop_store.py `LoopStore`; Any for the same reason).
LOOP_STORE: web.AppKey[Any] = web.AppKey("loop_store", object)
CONFIG: web.AppKey[ServerConfig] = web.AppKey("config", ServerConfig)
EXECUTOR: web.AppKey[ThreadPoolExecutor] = web.AppKey("executor", ThreadPoolExecutor)
SHARED_MEMORY: web.AppKey[SharedMemoryArenas] = web.AppKey("shared_memory", SharedMemoryArenas)
AUTH: web.AppKey[dict[bytes, str]] = web.AppKey("auth", dict)  # bearer token -> tenant; empty = no auth
METRICS: web.AppKey[Metrics] = web.AppKey("metrics", Metrics)
CATCH_UP: web.AppKey[CatchUp] = web.AppKey("catch_up", CatchUp)
FAST_PATH: web.AppKey[FastPath] = web.AppKey("fast_path", FastPath)  # the data plane, which serves every connection
# Request key: the tenant of the bearer token (absent without auth). RequestKey is aiohttp >= 3.13.
TENANT: Any = web.RequestKey("tenant", str) if hasattr(web, "RequestKey") else "kvstore.tenant"


def tenant_of(request: web.Request) -> str | None:
    return request.get(TENANT)


async def run_blocking(request: web.Request, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run `fn` on the app's thread pool: LMDB I/O and multi-MiB copies must not stall the loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app[EXECUTOR], functools.partial(fn, *args, **kwargs))
