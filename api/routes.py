"""The route table: every endpoint of the sidecar, in one place (docs/design.md §7.2).

`DATA_ROUTES` are the POST routes that move KV: each has one handler (api/handlers.py), which both
the fast path (api/fast_path.py) and aiohttp call. The rest are aiohttp's alone.

Adding an endpoint is one line here, one handler, and its entry in openapi.py (a test fails
until the OpenAPI document describes every route listed here).
"""
from __future__ import annotations

from aiohttp import web

from kvstore.api import handlers

DATA_ROUTES: dict[str, handlers.Handler] = {
    "/v1/lookup": handlers.lookup,
    "/v1/store": handlers.store,
    "/v1/fetch": handlers.fetch,
    "/v1/chunks/store": handlers.store_chunk,
    "/v1/blend": handlers.blend,
}

ROUTES: list[web.RouteDef] = [
    web.get("/healthz", handlers.healthz, allow_head=False),
    web.get("/metrics", handlers.metrics, allow_head=False),
    web.get("/openapi.json", handlers.openapi, allow_head=False),
    web.get("/v1/stats", handlers.stats, allow_head=False),
    web.put("/v1/models/{model:.+}", handlers.put_model),
    web.get("/v1/models/{model:.+}", handlers.get_model, allow_head=False),
    web.delete("/v1/models/{model:.+}", handlers.delete_model),
    web.post("/v1/shm", handlers.attach_shared_memory),
    *(web.post(path, handlers.aiohttp_handler(handler)) for path, handler in DATA_ROUTES.items()),
]
