"""Read an admin request's body (aiohttp's, api/admin_wire.py) into one buffer, allocated once; the
data routes' bodies are the data plane's (api/request_body.py).

aiohttp's `Request.read()` grows a bytearray chunk by chunk and then copies it into `bytes`
(two copies of every KV byte, plus reallocations). With a known Content-Length we allocate the
final buffer up front and copy each received chunk into place once; the buffer is writable, so
`torch.frombuffer` can view it without a warning or a copy.

A Content-Length is a claim, not bytes: only the first EAGER_ALLOC_BYTES are allocated up front,
and the buffer then grows (doubling) as bytes actually arrive, so a client that announces 1 GiB
and sends nothing costs 4 MiB, not 1 GiB. `deadline` (loop time) bounds how long a whole body
may take: a client that sends a byte a second is cut off (RequestTimeout) instead of holding a
connection and its buffer forever.
"""
from __future__ import annotations

import asyncio

import torch
from aiohttp import StreamReader

from kvstore.api.request_body import EAGER_ALLOC_BYTES  # the admin routes' bodies are read the same way
from kvstore.host_memory import empty_host

from kvstore.errors import InvalidRequest, PayloadTooLarge, RequestTimeout

# Let the transport run ahead of us by this much before aiohttp pauses reading: the default
# (128 KiB) would pause and resume the socket a dozen times per 2 MiB page.
READ_AHEAD_BYTES = 8 << 20


def _timed_out(got: int) -> RequestTimeout:
    return RequestTimeout(f"body: not received in time ({got} bytes arrived); "
                          "the server's --body-timeout-s bounds a whole body", field="body")


SMALL_BODY_BYTES = 64 << 10


async def read_exact(stream: StreamReader, nbytes: int, deadline: float | None = None) -> bytearray | memoryview:
    """Exactly `nbytes` from `stream` into one fresh writable buffer, one copy per byte."""
    if nbytes <= SMALL_BODY_BYTES and stream.total_bytes == nbytes:
        # Already here (it came with the head, as a lookup's or a shared-memory store's body
        # does): no timer, no read loop, which are a visible share of a lookup's cost.
        data = stream.read_nowait(-1)
        if len(data) == nbytes:
            return bytearray(data)
        raise InvalidRequest(f"body: {len(data)} bytes available, {nbytes} expected (Content-Length)", field="body")
    stream.set_read_chunk_size(min(max(nbytes, 1 << 16), READ_AHEAD_BYTES))
    got = [0]
    # One deadline for the whole body: a timer per chunk (wait_for) costs more than the reads.
    try:
        async with asyncio.timeout_at(deadline):
            return await _fill(stream, nbytes, got)
    except TimeoutError:
        raise _timed_out(got[0]) from None


async def _fill(stream: StreamReader, nbytes: int, got: list[int]) -> bytearray | memoryview:
    # A body that fits the eager size lands in huge pages, unzeroed: zero-filling a fresh 2 MiB
    # bytearray page-faulted 512 times before the first byte was copied in.
    buf: bytearray | memoryview = (empty_host((nbytes,), torch.uint8).numpy().data if nbytes <= EAGER_ALLOC_BYTES
                                   else bytearray(EAGER_ALLOC_BYTES))
    while got[0] < nbytes:
        chunk = await stream.readany()
        if not chunk:
            raise InvalidRequest(f"body: ended after {got[0]} of {nbytes} bytes (Content-Length)", field="body")
        end = got[0] + len(chunk)
        if end > nbytes:
            raise InvalidRequest(f"body: longer than its Content-Length of {nbytes} bytes", field="body")
        if end > len(buf):  # grow only for bytes that arrived (doubling: amortized one copy)
            assert isinstance(buf, bytearray)
            buf += bytes(min(nbytes, max(end, 2 * len(buf))) - len(buf))
        buf[got[0]:end] = chunk
        got[0] = end
    return buf


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
