"""The one error middleware: every failure leaves as `{"error": {"code", "message"}}`.

`KVStoreError` subclasses carry their code and HTTP status; aiohttp's own HTTP errors (unknown
route 404, wrong method 405) get the same body shape; anything else is a bug: logged with its
traceback and answered 500 without internals.
"""
from __future__ import annotations

import logging
from typing import Awaitable, Callable

from aiohttp import web

from kvstore.api import wire
from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore.api")

Handler = Callable[[web.Request], Awaitable[web.StreamResponse]]

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 413: "payload_too_large", 415: "unsupported_media_type"}


def error_response(request: web.Request, status: int, code: str, message: str) -> web.Response:
    response = wire.respond(request, {"error": {"code": code, "message": message}}, status=status)
    if status == 401:
        response.headers["WWW-Authenticate"] = 'Bearer realm="kvstore"'
    return response


def error_of(exc: Exception, method: str, path: str) -> tuple[int, str, str]:
    """(status, code, message) of a failure that is not aiohttp's own: a `KVStoreError` says
    them; anything else is a bug, logged with its traceback. The fast path answers its failures
    through this too, so both servers answer one failure alike."""
    if isinstance(exc, KVStoreError):
        if exc.status >= 500:
            log.warning("%s %s: %s: %s", method, path, exc.code, exc.message)
        return exc.status, exc.code, exc.message
    log.error("unhandled error in %s %s", method, path, exc_info=exc)
    return 500, KVStoreError.code, "internal error (logged by the server)"


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
