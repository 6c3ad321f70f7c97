"""The admin routes' handlers, as aiohttp serves them: health, metrics, the OpenAPI document,
stats and the model registry (api/admin/routes.py lists them).

Thin: parse (api/admin/wire.py) -> store call, on the app's pool where it could wait -> encode.
The data routes are not here: the data plane serves them (api/server/fast_path.py, api/server/handlers.py).
"""
from __future__ import annotations

from aiohttp import web

from kvstore.api.admin import wire as admin_wire
from kvstore.api.server import wire
from kvstore.api.admin.context import CONFIG, LOOP_STORE, METRICS, STORE, run_blocking, tenant_of
from kvstore.api.admin.openapi import openapi_document


async def _body(request: web.Request) -> dict:
    config = request.app[CONFIG]
    return await admin_wire.read_request(request, config.max_body_bytes, config.body_timeout_s)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    registry = request.app[METRICS]
    body = await run_blocking(request, registry.render)
    return web.Response(body=body, headers={"Content-Type": registry.content_type})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(request.app))


async def stats(request: web.Request) -> web.Response:
    return web.json_response(await run_blocking(request, request.app[STORE].stats))


async def audit(request: web.Request) -> web.Response:
    """An engine's audit of reused KV (kvstore/store_audit.py): counted; a failure drops the path."""
    body = await _body(request)
    wire.check_fields(body, ("model", "tokens", "passed"), ("tier", "layer", "salt", "chunk"))
    model, tokens = wire.model_name(body["model"]), wire.tokens(body["tokens"])
    report = await run_blocking(request, request.app[STORE].report_audit, model, tokens, passed=body["passed"],
                                tier=body.get("tier"), layer=body.get("layer"), tenant=tenant_of(request),
                                salt=body.get("salt"), chunk=body.get("chunk", False))
    return admin_wire.respond(request, {"dropped_pages": report.dropped_pages, "kept_pages": report.kept_pages})


async def put_model(request: web.Request) -> web.Response:
    model = wire.model_name(request.match_info["model"], field="model (path)")
    spec = wire.model_spec(await _body(request))
    tenant = tenant_of(request)
    created = await run_blocking(request, request.app[LOOP_STORE].register_model_created, model, spec, tenant=tenant)
    return admin_wire.respond(request, spec.to_dict(), status=201 if created else 200)


async def get_model(request: web.Request) -> web.Response:
    model = wire.model_name(request.match_info["model"], field="model (path)")
    spec = await run_blocking(request, request.app[STORE].get_spec, model, tenant=tenant_of(request))
    return admin_wire.respond(request, spec.to_dict())


async def delete_model(request: web.Request) -> web.Response:
    model = wire.model_name(request.match_info["model"], field="model (path)")
    dropped = await run_blocking(request, request.app[STORE].drop_model, model, tenant=tenant_of(request))
    return admin_wire.respond(request, {"dropped_pages": dropped})
