"""The route table: every endpoint of the sidecar, in one place (docs/design.md §7.2).

The data routes (api/server/handlers.py `DATA_ROUTES`: lookup, store, fetch, chunks/store, blend, shm)
are served by the data plane (api/server/fast_path.py), which reads every request of every connection.
`ROUTES` are the admin routes, the ones it hands to aiohttp: health, metrics, the OpenAPI
document, stats and the model registry; aiohttp also answers 404 and 405 for paths that are
neither.

Adding an endpoint is one line here (or in `DATA_ROUTES`), one handler, and its entry in
openapi.py (a test fails until the OpenAPI document describes every route).
"""
from __future__ import annotations

from aiohttp import web

from kvstore.api.admin import handlers as admin_handlers
from kvstore.api.server.handlers import DATA_ROUTES

__all__ = ["DATA_ROUTES", "ROUTES"]

ROUTES: list[web.RouteDef] = [
    web.get("/healthz", admin_handlers.healthz, allow_head=False),
    web.get("/metrics", admin_handlers.metrics, allow_head=False),
    web.get("/openapi.json", admin_handlers.openapi, allow_head=False),
    web.get("/v1/stats", admin_handlers.stats, allow_head=False),
    web.post("/v1/audit", admin_handlers.audit),
    web.put("/v1/models/{model:.+}", admin_handlers.put_model),
    web.get("/v1/models/{model:.+}", admin_handlers.get_model, allow_head=False),
    web.delete("/v1/models/{model:.+}", admin_handlers.delete_model),
]
