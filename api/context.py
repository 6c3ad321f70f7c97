"""What a handler reaches through its request: the store, the settings, the blocking-work pool.

Typed `AppKey`s instead of string keys, so a handler's `request.app[STORE]` is a `KVStore` to the
type checker. `run_blocking` is the one way handlers leave the event loop.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, TypeVar

from aiohttp import web

from kvstore.api.config import ServerConfig
from kvstore.api.shared_memory import SharedMemoryArenas

T = TypeVar("T")

STORE: web.AppKey[Any] = web.AppKey("store", object)  # a KVStore (kept Any: store.py imports torch, lmdb)
# The same store as the event loop calls it (api/loop_store.py `LoopStore`; Any for the same reason).
LOOP_STORE: web.AppKey[Any] = web.AppKey("loop_store", object)
CONFIG: web.AppKey[ServerConfig] = web.AppKey("config", ServerConfig)
EXECUTOR: web.AppKey[ThreadPoolExecutor] = web.AppKey("executor", ThreadPoolExecutor)
SHARED_MEMORY: web.AppKey[SharedMemoryArenas] = web.AppKey("shared_memory", SharedMemoryArenas)
AUTH: web.AppKey[dict[bytes, str]] = web.AppKey("auth", dict)  # bearer token -> tenant; empty = no auth
# Request key: the tenant of the bearer token (absent without auth). RequestKey is aiohttp >= 3.13.
TENANT: Any = web.RequestKey("tenant", str) if hasattr(web, "RequestKey") else "kvstore.tenant"


def tenant_of(request: web.Request) -> str | None:
    return request.get(TENANT)


async def run_blocking(request: web.Request, fn: Callable[..., T], *args: Any, **kwargs: Any) -> T:
    """Run `fn` on the app's thread pool: LMDB I/O and multi-MiB copies must not stall the loop."""
    loop = asyncio.get_running_loop()
    return await loop.run_in_executor(request.app[EXECUTOR], functools.partial(fn, *args, **kwargs))
