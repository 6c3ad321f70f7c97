"""aiohttp's middleware chain, which only the admin routes pass through (the data plane,
api/server/fast_path.py, does the same for the data routes as it reads and answers them).

Outermost first (api/admin/app.py): `learn_after` lets the eviction policy learn once the answer is out;
`count_answers` tells the data plane an answer is written, so that the connection's next request
may be answered; `measure` counts every answer by route template and status; `errors` turns every
failure into `{"error": {"code", "message"}}` (api/server/failures.py `error_of`; aiohttp's own 404 and
405 get the same shape); `authenticate` checks the bearer token before any handler.
"""
from __future__ import annotations

import time
from typing import Awaitable, Callable

from aiohttp import web

from kvstore.api.admin.wire import respond
from kvstore.api.server.auth import PROTECTED_PREFIX, bearer_tenant
from kvstore.api.admin.context import AUTH, CATCH_UP, FAST_PATH, METRICS, TENANT
from kvstore.api.server.failures import error_of
from kvstore.api.server.metrics import UNMATCHED
from kvstore.errors import KVStoreError

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large", 415: "unsupported_media_type"}


def error_response(request: web.Request, status: int, code: str, message: str) -> web.Response:
    response = respond(request, {"error": {"code": code, "message": message}}, status=status)
    if status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="kvstore"'
    return response


@web.middleware
async def learn_after(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Every admin request queues a catch-up of the policy (api/server/catch_up.py)."""
    try:
        return await handler(request)
    finally:
        request.app[CATCH_UP].soon()


@web.middleware
async def count_answers(request: web.Request, handler: Handler) -> web.StreamResponse:
    """Writes the answer itself, then tells the connection (api/server/connection.py `Connection`) it is
    out: the connection holds its next request until then, so answers leave in request order."""
    try:
        response = await handler(request)
    except web.HTTPException as exc:  # under 400 (errors answers the rest): the exception is the answer
        await _write(request, exc)
        raise
    await _write(request, response)
    return response


async def _write(request: web.Request, response: web.StreamResponse) -> None:
    await response.prepare(request)  # aiohttp would write it after we return; it skips a written one
    await response.write_eof()
    request.app[FAST_PATH].answered_by_aiohttp(request.transport)


def route_label(request: web.Request) -> str:
    route = request.match_info.route
    resource = route.resource if route is not None else None
    return resource.canonical if resource is not None else UNMATCHED


@web.middleware
async def measure(request: web.Request, handler: Handler) -> web.StreamResponse:
    metrics = request.app[METRICS]
    began = time.perf_counter()
    status = 500
    try:
        response = await handler(request)
        status = response.status
        return response
    except web.HTTPException as exc:
        status = exc.status
        raise
    finally:
        route = route_label(request)
        metrics.requests.labels(route, request.method, str(status)).inc()
        metrics.latency.labels(route, request.method).observe(time.perf_counter() - began)


@web.middleware
async def errors(request: web.Request, handler: Handler) -> web.StreamResponse:
    try:
        return await handler(request)
    except KVStoreError as exc:
        status, code, message = error_of(exc, request.method, request.path)
        response = error_response(request, status, code, message)
        if exc.status in (408, 413):  # the rest of the body may still be on its way: do not read it
            response.force_close()
        return response
    except web.HTTPException as exc:
        if exc.status < 400:
            raise
        code = _HTTP_CODES.get(exc.status, f"http_{exc.status}")
        response = error_response(request, exc.status, code, f"{request.method} {request.path}: {exc.reason}")
        if exc.status == 405 and "Allow" in exc.headers:
            response.headers["Allow"] = exc.headers["Allow"]
        return response
    except Exception as exc:
        return error_response(request, *error_of(exc, request.method, request.path))


@web.middleware
async def authenticate(request: web.Request, handler: Handler) -> web.StreamResponse:
    table = request.app[AUTH]
    if table and request.path.startswith(PROTECTED_PREFIX):
        request[TENANT] = bearer_tenant(table, request.headers.get("Authorization", ""))
    return await handler(request)
