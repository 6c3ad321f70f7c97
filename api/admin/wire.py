"""The wire format as aiohttp's handlers read and answer it: the admin routes' bodies and answers.

The data routes never come here: the data plane (api/server/fast_path.py) reads their bodies and writes
their answers itself. What both share (decoding, the fields, JSON or msgpack) is api/server/wire.py.
"""
from __future__ import annotations

import asyncio
from typing import Any

import msgpack
from aiohttp import web

from kvstore.api.admin.body import read_exact, read_limited
from kvstore.api.server.wire import (DEFAULT_TYPES, JSON, MSGPACK, MSGPACK_TYPES, answer_in_json, decode_json,
                                     decode_msgpack)
from kvstore.errors import PayloadTooLarge, UnsupportedMediaType


async def read_request(request: web.Request, max_body_bytes: int,
                       body_timeout_s: float | None = None) -> dict[str, Any]:
    """Read the body once and decode its top-level map (bin fields stay views of the body)."""
    ctype = request.content_type if request.headers.get("Content-Type") else ""
    if ctype not in MSGPACK_TYPES and ctype not in DEFAULT_TYPES and ctype != JSON:
        raise UnsupportedMediaType(f"Content-Type: expected {MSGPACK} or {JSON}, got {ctype!r}", field="Content-Type")
    length = request.content_length
    if length is not None and length > max_body_bytes:
        raise PayloadTooLarge(f"body: {length} bytes exceeds the limit of {max_body_bytes} bytes", field="body")
    deadline = None if body_timeout_s is None else asyncio.get_running_loop().time() + body_timeout_s
    body = await (read_exact(request.content, length, deadline) if length is not None
                  else read_limited(request.content, max_body_bytes, deadline))
    return decode_json(body) if ctype == JSON else decode_msgpack(body)


def wants_json(request: web.Request) -> bool:
    return answer_in_json(request.headers.get("Accept", ""), request.content_type, request.method)


def respond(request: web.Request, obj: Any, status: int = 200) -> web.Response:
    if wants_json(request):
        return web.json_response(obj, status=status)
    return web.Response(body=msgpack.packb(obj, use_bin_type=True), status=status, content_type=MSGPACK)
