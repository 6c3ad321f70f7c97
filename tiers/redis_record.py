"""One page record as one Redis value: the disk tier's record format (tiers/disk_record.py),
framed into a single string so a page is written and read atomically with one SET / GET.

    value = u32 LE header length | header (crc32 + msgpack, as on disk) | stored payload

The header carries the payload's checksum and stored length, the token ids and the key, so a
truncated, overwritten or foreign value fails `decode_value` with `CorruptRecord` and becomes a
miss, never wrong KV. What this module does not do: talk to Redis.
"""
from __future__ import annotations

from typing import Any

import zstandard

from kvstore.tiers.base import PageRecord
from kvstore.tiers.disk_record import CorruptRecord, decode_header, encode_header, header_to_record, payload_checksum

LENGTH_BYTES = 4


def payload_view(payload: Any) -> memoryview:
    """A flat byte view of a payload given as bytes, a memoryview or a uint8 torch tensor."""
    if hasattr(payload, "numpy"):
        return memoryview(payload.contiguous().numpy()).cast("B")
    return memoryview(payload).cast("B")


def encode_value(record: PageRecord, compressor: zstandard.ZstdCompressor | None) -> bytes:
    """The Redis value of `record`: one copy of the payload (two with zstd)."""
    payload = payload_view(record.payload)
    stored = compressor.compress(payload) if compressor is not None else payload
    header = encode_header(record, compression="zstd" if compressor is not None else "none", stored_payload=stored)
    return b"".join((len(header).to_bytes(LENGTH_BYTES, "little"), header, stored))


def decode_value(value: Any, key: bytes) -> PageRecord:
    """The record in `value` (bytes, or a uint8 tensor as tiers/redis_reader.py receives it),
    its payload a zero-copy view of `value` unless it was compressed. The payload is hashed
    once, where it lies. Raises CorruptRecord on anything that does not check out."""
    view = payload_view(value)
    if len(view) < LENGTH_BYTES:
        raise CorruptRecord("value shorter than its length field")
    header_len = int.from_bytes(view[:LENGTH_BYTES], "little")
    end = LENGTH_BYTES + header_len
    if end > len(view):
        raise CorruptRecord("header length beyond the value")
    header = decode_header(bytes(view[LENGTH_BYTES:end]), key)
    payload: Any = view[end:]
    if len(payload) != header["size"] or payload_checksum(payload) != header["checksum"]:
        raise CorruptRecord("payload checksum mismatch")
    if header["comp"] == "zstd":
        try:
            payload = zstandard.ZstdDecompressor().decompress(payload)
        except zstandard.ZstdError as exc:
            raise CorruptRecord(f"zstd: {exc}") from None
    elif header["comp"] != "none":
        raise CorruptRecord(f"unknown compression {header['comp']!r}")
    return header_to_record(header, payload)


def decode_value_header(prefix: bytes, key: bytes) -> PageRecord | None:
    """The header of a value from its first bytes (payload None); None: `prefix` is too short
    to hold it (read more). Raises CorruptRecord on a malformed header."""
    if len(prefix) < LENGTH_BYTES:
        raise CorruptRecord("value shorter than its length field")
    end = LENGTH_BYTES + int.from_bytes(prefix[:LENGTH_BYTES], "little")
    if end > len(prefix):
        return None
    return header_to_record(decode_header(bytes(prefix[LENGTH_BYTES:end]), key))
