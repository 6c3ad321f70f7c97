"""What a failed request is answered with: `error_of(exc, method, path) -> (status, code, message)`.

One mapping for both servers: the data plane (api/server/fast_path.py) answers its failures through it,
and aiohttp's error middleware (api/admin/middleware.py) the admin routes'. `KVStoreError` subclasses
carry their code and HTTP status; anything else is a bug: logged with its traceback and answered
500 without internals.
"""
from __future__ import annotations

import logging

from kvstore.errors import KVStoreError

log = logging.getLogger("kvstore.api")


def error_of(exc: BaseException, method: str, path: str) -> tuple[int, str, str]:
    """(status, code, message) of a failure that is not an HTTP framing error."""
    if isinstance(exc, KVStoreError):
        if exc.status >= 500:
            log.warning("%s %s: %s: %s", method, path, exc.code, exc.message)
        return exc.status, exc.code, exc.message
    log.error("unhandled error in %s %s", method, path, exc_info=exc)
    return 500, KVStoreError.code, "internal error (logged by the server)"
