"""Read an admin request's body (aiohttp's, api/admin/wire.py) into one buffer; the data routes'
bodies are the data plane's. Both gather into `BodyBuffer` (api/server/request_body.py): with a known
Content-Length each received chunk is copied into place once, and a Content-Length is a claim,
not bytes, so the buffer grows only as bytes arrive. `deadline` (loop time) bounds how long a
whole body may take: a client that sends a byte a second is cut off (RequestTimeout) instead of
holding a connection and its buffer forever.
"""
from __future__ import annotations

import asyncio

from aiohttp import StreamReader

from kvstore.api.server.request_body import BodyBuffer
from kvstore.errors import InvalidRequest, PayloadTooLarge, RequestTimeout


def _timed_out(got: int) -> RequestTimeout:
    return RequestTimeout(f"body: not received in time ({got} bytes arrived); "
                          "the server's --body-timeout-s bounds a whole body", field="body")


async def read_exact(stream: StreamReader, nbytes: int, deadline: float | None = None) -> bytearray | memoryview:
    """Exactly `nbytes` from `stream` into one writable buffer, one copy per byte."""
    body = BodyBuffer(nbytes)
    try:
        async with asyncio.timeout_at(deadline):
            while not body.done:
                chunk = await stream.readany()
                if not chunk:
                    raise InvalidRequest(f"body: ended after {body.got} of {nbytes} bytes (Content-Length)",
                                         field="body")
                if body.add(chunk) < len(chunk):
                    raise InvalidRequest(f"body: longer than its Content-Length of {nbytes} bytes", field="body")
    except TimeoutError:
        raise _timed_out(body.got) from None
    return body.body()


async def read_limited(stream: StreamReader, max_bytes: int, deadline: float | None = None) -> bytearray:
    """A body of unknown length (chunked transfer encoding), refused past `max_bytes`."""
    buf = bytearray()
    try:
        async with asyncio.timeout_at(deadline):
            while chunk := await stream.readany():
                buf += chunk
                if len(buf) > max_bytes:
                    raise PayloadTooLarge(f"body: exceeds the limit of {max_bytes} bytes", field="body")
    except TimeoutError:
        raise _timed_out(len(buf)) from None
    return buf
