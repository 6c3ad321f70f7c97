"""`create_app(store, config)`: the aiohttp application around one store.

The app does not own the store (whoever made it closes it, after the app has finished its
in-flight requests); it owns its thread pool, which it shuts down on cleanup, waiting for
running store calls so that closing the store afterwards is safe.
"""
from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from typing import Any

from aiohttp import web

from kvstore.api.auth import authenticate, load_auth_file
from kvstore.api.catch_up import CATCH_UP, CatchUp, learn_after
from kvstore.api.config import ServerConfig
from kvstore.api.context import AUTH, CONFIG, EXECUTOR, LOOP_STORE, SHARED_MEMORY, STORE
from kvstore.api.fast_path import FAST_PATH, FastPath, count_answers
from kvstore.api.loop_store import LoopStore
from kvstore.api.metrics import METRICS, Metrics, measure
from kvstore.api.middleware import errors
from kvstore.api.routes import ROUTES
from kvstore.api.shared_memory import SharedMemoryArenas


def create_app(store: Any, config: ServerConfig | None = None) -> web.Application:
    config = config or ServerConfig()
    # Order: metrics sees the final status of everything, errors turns exceptions (auth's 401
    # included) into bodies, auth runs before any handler.
    # count_answers (with the fast path only) sees an answer once it is written; learn_after,
    # outermost, then lets the eviction policy learn from the request (api/catch_up.py).
    middlewares = [learn_after] + ([count_answers] if config.fast_path else []) + [measure, errors, authenticate]
    app = web.Application(middlewares=middlewares, client_max_size=config.max_body_bytes)
    app[STORE] = store
    app[LOOP_STORE] = loop_store = LoopStore(store)
    loop_store.learn_later(True)
    app[CATCH_UP] = CatchUp(loop_store)
    app[CONFIG] = config
    auth = load_auth_file(config.auth_file) if config.auth_file else None
    app[AUTH] = auth.tokens if auth else {}
    for tenant, max_bytes in (auth.quotas if auth else {}).items():
        store.set_tenant_quota(tenant, max_bytes)
    app[EXECUTOR] = ThreadPoolExecutor(config.executor_threads, thread_name_prefix="kvstore-api")
    app[METRICS] = Metrics(store.stats)
    app[SHARED_MEMORY] = SharedMemoryArenas(config.shared_memory)
    app.add_routes(ROUTES)
    if config.fast_path:
        app[FAST_PATH] = FastPath(app)
    app.on_cleanup.append(_shutdown_executor)
    return app


async def _shutdown_executor(app: web.Application) -> None:
    app[EXECUTOR].shutdown(wait=True)
    app[LOOP_STORE].learn_later(False)  # catches up; the store learns inline again for other callers
