"""A data request's body, gathered from the connection's reads into one buffer, allocated once.

With a Content-Length known, the final buffer is allocated up front and each read is copied into
place once; it is writable, so a store's kv is viewed in place as a tensor (api/server/wire.py), never
copied again. A Content-Length is a claim, not bytes: only the first EAGER_ALLOC_BYTES are
allocated up front, and the buffer then grows (doubling) as bytes actually arrive, so a client
that announces 1 GiB and sends nothing costs 4 MiB, not 1 GiB. (The data plane bounds how long
a whole body may take: api/server/connection.py, body_timeout_s.)
"""
from __future__ import annotations

import torch

from kvstore.host_memory import empty_host

EAGER_ALLOC_BYTES = 4 << 20  # a 2 MiB page and its fields fit: the common body is never regrown
SMALL_BODY_BYTES = 64 << 10  # below this a plain bytearray: cheaper to make than a host buffer


class BodyBuffer:
    """Invariant: `view[:got]` holds the body's first `got` bytes; `got <= nbytes`."""

    __slots__ = ("nbytes", "got", "buf")

    def __init__(self, nbytes: int):
        self.nbytes = nbytes
        self.got = 0
        # A body that fits the eager size lands in huge pages, unzeroed: zero-filling a fresh 2 MiB
        # bytearray page-faulted 512 times before the first byte was copied in.
        self.buf: bytearray | memoryview = (
            bytearray(nbytes) if nbytes <= SMALL_BODY_BYTES
            else empty_host((nbytes,), torch.uint8).numpy().data if nbytes <= EAGER_ALLOC_BYTES
            else bytearray(EAGER_ALLOC_BYTES))

    @property
    def done(self) -> bool:
        return self.got == self.nbytes

    def add(self, data: bytes | bytearray | memoryview) -> int:
        """Copy what `data` holds of the body in place -> how many bytes of it were the body's."""
        step = min(len(data), self.nbytes - self.got)
        end = self.got + step
        if end > len(self.buf):  # grow only for bytes that arrived (doubling: amortized one copy)
            assert isinstance(self.buf, bytearray)
            self.buf += bytes(min(self.nbytes, max(end, 2 * len(self.buf))) - len(self.buf))
        self.buf[self.got:end] = data[:step] if step < len(data) else data
        self.got = end
        return step

    def body(self) -> bytearray | memoryview:
        return self.buf
