"""`create_app(store, config)`: the sidecar around one store: its state, its data plane and the
aiohttp application of its admin routes.

The app does not own the store (whoever made it closes it, after the app has finished its
in-flight requests); it owns its thread pool, which it shuts down on cleanup, waiting for
running store calls so that closing the store afterwards is safe. On shutdown the data plane
finishes its requests under way first (api/server/fast_path.py `drain`).
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from kvstore.api.server.auth import load_auth_file
from kvstore.api.server.catch_up import CatchUp
from kvstore.api.server.config import ServerConfig
from kvstore.api.admin.context import (AUTH, CATCH_UP, CONFIG, EXECUTOR, FAST_PATH, LOOP_STORE, METRICS, SHARED_MEMORY,
                                 STATE, STORE)
from kvstore.api.server.fast_path import FastPath
from kvstore.api.server.loop_store import LoopStore
from kvstore.api.server.metrics import Metrics
from kvstore.api.admin.middleware import authenticate, count_answers, errors, learn_after, measure
from kvstore.api.admin.routes import ROUTES
from kvstore.api.server.shared_memory import SharedMemoryArenas
from kvstore.api.server.state import SidecarState


def create_app(store: Any, config: ServerConfig | None = None, *, keepalive_timeout_s: float = 75.0) -> web.Application:
    """`keepalive_timeout_s`: how long a connection may sit with no request under way before the
    data plane closes it."""
    config = config or ServerConfig()
    auth = load_auth_file(config.auth_file) if config.auth_file else None
    loop_store = LoopStore(store)
    loop_store.learn_later(True)
    state = SidecarState(
        store=store, loop_store=loop_store, config=config,
        executor=ThreadPoolExecutor(config.executor_threads, thread_name_prefix="kvstore-api"),
        shared_memory=SharedMemoryArenas(config.shared_memory), auth=auth.tokens if auth else {},
        metrics=Metrics(store.stats), catch_up=CatchUp(loop_store))
    for tenant, max_bytes in (auth.quotas if auth else {}).items():
        store.set_tenant_quota(tenant, max_bytes)
    # Order (api/admin/middleware.py): learn_after, outermost, lets the eviction policy learn once the
    # answer is out; count_answers tells the data plane it is out; metrics sees the final status
    # of everything; errors turns exceptions (auth's 401 included) into bodies; auth runs before
    # any handler.
    app = web.Application(middlewares=[learn_after, count_answers, measure, errors, authenticate],
                          client_max_size=config.max_body_bytes)
    app[STATE] = state
    app[STORE], app[LOOP_STORE], app[CONFIG], app[EXECUTOR] = store, loop_store, config, state.executor
    app[SHARED_MEMORY], app[AUTH], app[METRICS], app[CATCH_UP] = (state.shared_memory, state.auth, state.metrics,
                                                                  state.catch_up)
    app[FAST_PATH] = FastPath(state, keepalive_timeout_s)
    app.add_routes(ROUTES)
    app.on_shutdown.append(_drain)
    app.on_cleanup.append(_shutdown_executor)
    return app


async def _drain(app: web.Application) -> None:
    await app[FAST_PATH].drain(app[CONFIG].shutdown_timeout_s)


async def _shutdown_executor(app: web.Application) -> None:
    app[EXECUTOR].shutdown(wait=True)
    app[LOOP_STORE].learn_later(False)  # catches up; the store learns inline again for other callers
