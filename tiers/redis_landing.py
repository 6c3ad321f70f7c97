"""A Redis page record received with its payload straight in the caller's buffers.

A fetch answer is (L, 2, T, H, D); one page's KV in it is L x 2 contiguous slices of one length,
and an uncompressed record's payload is those same slices back to back: the rows of one strided
(L x 2, slice bytes) uint8 view of the answer. Receiving the payload into
them skips a 2 MiB page's copy out of a fresh buffer (and that buffer's allocation): the bytes
go from the socket to where the caller returns them, and the checksum is computed over each
piece as it lands, while it is in cache.

- `Landing(rows, accepts)`: where a payload goes (the rows of a 2-D uint8 view, filled in order;
  the disk tier fills them with one strided copy, a socket through `chunks`, one byte view a
  row), and the caller's decision on the header (the tier does not know pages: the store's tier
  stack says which record fits which slices).
- `receive_record(reader, nbytes, key, landing)`, a `Receiver` for tiers/redis_reader.py: reads
  the value's length field and header first; when the header is intact, uncompressed, sized
  exactly for the chunks and accepted, receives the payload into them and returns the record
  with `payload=landing`, or a `CorruptRecord` (returned, not raised: the pipeline goes on) when
  the payload fails its checksum. Anything else (zstd, a foreign, truncated or malformed value,
  another page's size) is received as today, into one fresh tensor, for `decode_value` to judge;
  so is every value on a socket without `recvmsg_into` (TLS).

The chunks hold whatever arrived even when the record is then rejected: the caller must treat
them as garbage unless it got the record back (the store serves a fetch only up to the first
page it lost). What it does not do: talk RESP (the reader does) or decode compressed payloads.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np
import xxhash

from kvstore.tiers.base import PageRecord
from kvstore.tiers.disk_record import CorruptRecord, decode_header, header_to_record
from kvstore.tiers.redis_record import LENGTH_BYTES

if TYPE_CHECKING:  # the store's tier stack imports Landing without loading redis-py
    import torch

    from kvstore.tiers.redis_reader import ReplyReader

MAX_LANDING_HEADER_BYTES = 1 << 20  # a page's header is its token ids plus ~150 bytes


class Landing:
    """Where one record's payload may go, and whether its header may go there. Made once a page
    on every fetch that lands payloads: a class with slots, whose constructor costs less than a
    frozen dataclass's. Treated as immutable."""

    __slots__ = ("rows", "accepts")

    def __init__(self, rows: np.ndarray, accepts: Callable[[PageRecord], bool]):
        # (rows, row bytes) uint8, writable, each row contiguous (rows may be strided apart):
        # the payload's bytes in row order. A numpy view, not byte views per row: one is sliced
        # per page out of the answer's (L x 2, answer row bytes) view, and a copy into it is one
        # np.copyto.
        self.rows = rows
        self.accepts = accepts  # the header (payload None): receive into rows?

    @property
    def nbytes(self) -> int:
        return self.rows.nbytes

    @property
    def chunks(self) -> tuple[memoryview, ...]:
        """One writable byte view per row, in order (what recvmsg_into scatters into)."""
        return tuple(map(memoryview, self.rows))


def receive_record(reader: ReplyReader, nbytes: int, key: bytes,
                   landing: Landing) -> PageRecord | CorruptRecord | torch.Tensor:
    """The value of `key` (a bulk reply of `nbytes`), its payload received into `landing` when
    the header allows: the landed record, a CorruptRecord, or the whole value as a tensor."""
    if nbytes < LENGTH_BYTES or not reader.scatters:
        # Without recvmsg_into (TLS) a recv per slice measured slower than the copy it saves.
        return reader.read_bulk(nbytes)
    length = reader.read_exact(LENGTH_BYTES)
    header_bytes = int.from_bytes(length, "little")
    payload_bytes = nbytes - LENGTH_BYTES - header_bytes
    if header_bytes > MAX_LANDING_HEADER_BYTES or payload_bytes != landing.nbytes:
        return reader.read_bulk(nbytes, length)
    header_value = reader.read_exact(header_bytes)
    try:
        header = decode_header(header_value, key)
    except CorruptRecord:
        return reader.read_bulk(nbytes, length + header_value)  # decode_value says why
    record = header_to_record(header)
    if header["comp"] != "none" or header["size"] != payload_bytes or not landing.accepts(record):
        return reader.read_bulk(nbytes, length + header_value)
    # The streaming form of disk_record.payload_checksum (xxh3-64): same digest, piece by piece.
    digest = xxhash.xxh3_64()
    reader.fill_chunks(landing.chunks, digest.update)
    reader.end_bulk()
    if digest.intdigest() != header["checksum"]:
        return CorruptRecord("payload checksum mismatch")
    return header_to_record(header, landing)
