"""Store records (kvstore/kv_events/recorder.py) packed straight into a `KVEventBatch` payload.

The bytes are exactly `encode_batch` of the events the records stand for (a test holds them to
it), built from pieces: every field of an event that is the same for all pages of a model in a
tier (keys, `block_size`, `medium`, `extra_keys`, ...) is packed once and reused, and only the
hashes and token ids are packed per event. The publisher's thread runs this on every event and
shares the interpreter with the store's threads, so it does as little as it can.
"""
from __future__ import annotations

import struct
from typing import Any

import msgpack

from kvstore.kv_events.recorder import REMOVED, STORED, Record
from kvstore.kv_events.wire import HASH_MASK, TIER_MEDIA, token_list

_pack = msgpack.Packer(use_bin_type=True).pack


def _entries(**fields: Any) -> bytes:
    return b"".join(_pack(k) + _pack(v) for k, v in fields.items())


def _map_header(n: int) -> bytes:
    assert n < 16
    return bytes([0x80 | n])


def _array_header(n: int) -> bytes:
    if n < 16:
        return bytes([0x90 | n])
    if n < 1 << 16:
        return b"\xdc" + struct.pack(">H", n)
    return b"\xdd" + struct.pack(">I", n)


_STORED_HEAD = _entries(type="BlockStored") + _pack("block_hashes") + b"\x91"  # then the hash
_PARENT = _pack("parent_block_hash")
_TOKENS = _pack("token_ids")
_REMOVED_HEAD = _entries(type="BlockRemoved") + _pack("block_hashes") + b"\x91"  # then the hash
_CLEARED = _map_header(1) + _entries(type="AllBlocksCleared")


class RecordPacker:
    def __init__(self) -> None:
        # (tier, extra key, block size) -> (map header, the constant fields after token_ids)
        self._stored_tail: dict[tuple, tuple[bytes, bytes]] = {}
        self._removed_parts: dict[str, tuple[bytes, bytes]] = {}

    def _stored(self, tier: str, extra: Any, block_size: int) -> tuple[bytes, bytes]:
        key = (tier, extra, block_size)
        found = self._stored_tail.get(key)
        if found is None:
            medium, locality = TIER_MEDIA.get(tier, (tier.upper(), None))
            fields = dict(block_size=block_size, lora_id=None, medium=medium, lora_name=None, extra_keys=[extra])
            if locality is not None:
                fields["locality"] = locality
            found = self._stored_tail[key] = (_map_header(4 + len(fields)), _entries(**fields))
        return found

    def _removed(self, tier: str) -> tuple[bytes, bytes]:
        """(the event up to its hash, the fields after it)."""
        found = self._removed_parts.get(tier)
        if found is None:
            medium, locality = TIER_MEDIA.get(tier, (tier.upper(), None))
            rest = dict(medium=medium, **({"locality": locality} if locality is not None else {}))
            found = self._removed_parts[tier] = (_map_header(2 + len(rest)) + _REMOVED_HEAD, _entries(**rest))
        return found

    def pack(self, ts: float, records: list[Record], data_parallel_rank: int | None) -> bytes:
        parts = [b"\x93", _pack(ts), _array_header(len(records))]
        add = parts.append
        for record in records:
            kind = record[0]
            if kind == STORED:
                _, key, parent, tokens, tier, (extra, block_size) = record
                header, tail = self._stored(tier, extra, block_size)
                add(header)
                add(_STORED_HEAD)
                add(_pack(int.from_bytes(key, "big") & HASH_MASK))
                add(_PARENT)
                add(_pack(None if parent is None else int.from_bytes(parent, "big") & HASH_MASK))
                add(_TOKENS)
                add(_pack(token_list(tokens)))
                add(tail)
            elif kind == REMOVED:
                head, rest = self._removed(record[2])
                add(head)
                add(_pack(int.from_bytes(record[1], "big") & HASH_MASK))
                add(rest)
            else:
                add(_CLEARED)
        add(_pack(data_parallel_rank))
        return b"".join(parts)
