"""The on-disk record format of the disk tier (and the Redis tier): header + payload.

    meta value = crc32(header) as 4 bytes LE | msgpack header
    data value = payload (codec-encoded KV, zstd-compressed when the header says so)

The header names everything needed to rebuild the index after a restart without reading
payloads (namespace, key, parent key, token ids, codec, dtype, shape, kind) plus the payload's
checksum (xxh3-64: several times faster than crc32, which was a visible share of a page's read
time) and stored length. The small header itself is guarded by crc32. `decode_header` raises
`CorruptRecord` on anything malformed: random
bytes, a bad checksum, wrong field types; a corrupt record becomes a miss, never wrong KV.
"""
from __future__ import annotations

import zlib

import msgpack
import xxhash

from kvstore.tiers.base import PageRecord

FORMAT_VERSION = 2  # 2: payload checksum xxh3-64 (was crc32)
_MAX_HEADER_BYTES = 1 << 24
_FIELDS = {"v": int, "ns": bytes, "key": bytes, "parent": bytes, "tokens": bytes, "codec": str,
           "dtype": str, "shape": list, "kind": str, "comp": str, "checksum": int, "size": int}


class CorruptRecord(Exception):
    """A record failed its checksum or does not parse."""


def payload_checksum(payload) -> int:
    return xxhash.xxh3_64_intdigest(payload)


# The streaming form of `payload_checksum`: `payload_digest()`, then `update` it piece by piece,
# in order; its `intdigest()` is the same checksum. The class itself, not a function making one:
# a disk read makes one per page.
payload_digest = xxhash.xxh3_64


def encode_header(record: PageRecord, *, compression: str, stored_payload) -> bytes:
    header = msgpack.packb({
        "v": FORMAT_VERSION, "ns": record.namespace, "key": record.key, "parent": record.parent,
        "tokens": record.tokens, "codec": record.codec, "dtype": record.dtype,
        "shape": list(record.shape), "kind": record.kind, "comp": compression,
        "checksum": payload_checksum(stored_payload), "size": len(stored_payload),
    }, use_bin_type=True)
    return (zlib.crc32(header) & 0xFFFFFFFF).to_bytes(4, "little") + header


def decode_header(value: bytes, key: bytes) -> dict:
    if len(value) < 5 or len(value) > _MAX_HEADER_BYTES:
        raise CorruptRecord("header length out of range")
    header_bytes = value[4:]
    if int.from_bytes(value[:4], "little") != (zlib.crc32(header_bytes) & 0xFFFFFFFF):
        raise CorruptRecord("header checksum mismatch")
    try:
        header = msgpack.unpackb(header_bytes, raw=False, max_bin_len=_MAX_HEADER_BYTES,
                                 max_str_len=1024, max_array_len=16, max_map_len=32)
    except Exception as exc:  # msgpack raises several types on garbage
        raise CorruptRecord(f"header does not parse: {exc}") from None
    if not isinstance(header, dict):
        raise CorruptRecord("header is not a map")
    for name, kind in _FIELDS.items():
        if not isinstance(header.get(name), kind):
            raise CorruptRecord(f"header field {name!r} missing or not {kind.__name__}")
    if header["v"] != FORMAT_VERSION or header["key"] != key or len(header["tokens"]) % 4:
        raise CorruptRecord("header does not describe this key")
    return header


def header_to_record(header: dict, payload=None) -> PageRecord:
    return PageRecord(namespace=header["ns"], key=header["key"], parent=header["parent"],
                      tokens=header["tokens"], codec=header["codec"], dtype=header["dtype"],
                      shape=tuple(header["shape"]), payload=payload, kind=header["kind"])
