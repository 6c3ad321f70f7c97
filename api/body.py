"""Read an HTTP body into one buffer, allocated once.

aiohttp's `Request.read()` grows a bytearray chunk by chunk and then copies it into `bytes`
(two copies of every KV byte, plus reallocations). With a known Content-Length we allocate the
final buffer up front and copy each received chunk into place once; the buffer is writable, so
`torch.frombuffer` can view it without a warning or a copy. Used by the server and the async
client alike.
"""
from __future__ import annotations

from aiohttp import StreamReader

from kvstore.errors import InvalidRequest, PayloadTooLarge

# Let the transport run ahead of us by this much before aiohttp pauses reading: the default
# (128 KiB) would pause and resume the socket a dozen times per 2 MiB page.
READ_AHEAD_BYTES = 8 << 20


async def read_exact(stream: StreamReader, nbytes: int) -> bytearray:
    """Exactly `nbytes` from `stream` into a fresh bytearray, one copy per byte."""
    stream.set_read_chunk_size(min(max(nbytes, 1 << 16), READ_AHEAD_BYTES))
    buf = bytearray(nbytes)
    view = memoryview(buf)
    got = 0
    while got < nbytes:
        chunk = await stream.readany()
        if not chunk:
            raise InvalidRequest(f"body: ended after {got} of {nbytes} bytes (Content-Length)", field="body")
        end = got + len(chunk)
        if end > nbytes:
            raise InvalidRequest(f"body: longer than its Content-Length of {nbytes} bytes", field="body")
        view[got:end] = chunk
        got = end
    return buf


async def read_limited(stream: StreamReader, max_bytes: int) -> bytearray:
    """A body of unknown length (chunked transfer encoding), refused past `max_bytes`."""
    buf = bytearray()
    while chunk := await stream.readany():
        buf += chunk
        if len(buf) > max_bytes:
            raise PayloadTooLarge(f"body: exceeds the limit of {max_bytes} bytes", field="body")
    return buf
