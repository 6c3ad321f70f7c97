"""KV events on vLLM's wire: `BlockStored`, `BlockRemoved`, `AllBlocksCleared` in a `KVEventBatch`.

The layout is the one vLLM's msgspec structs encode to (vllm/distributed/kv_events.py), so
vLLM's own decoder (`msgspec.msgpack.Decoder(KVEventBatch)`) and every consumer built on it
(llm-d's KV-cache indexer, Dynamo's KV router) read these unchanged:

    KVEventBatch   array  [ts, events, data_parallel_rank]
    an event       map    {"type": "BlockStored", field: value, ...}   (a tagged struct)

Fields that have a default in vLLM are left out when they hold it (its `omit_defaults`); the
ones without (`lora_id`, `medium`, `lora_name`, ...) are always written, None or not.

Block hashes are the store's page keys (the chained prefix keys of docs/design.md §2) as
64-bit integers (`block_hash`), the form vLLM publishes its own in by default and routers index.

A tier's copy of a page is reported under the medium of that tier (`TIER_MEDIA`): gpu "GPU",
cpu "CPU", disk "STORAGE" (locality "LOCAL"), redis "STORAGE" with locality "REMOTE" (a tier
other sidecars share). A subscriber keys what it holds by (medium, locality).

This module only describes and encodes events; the store reports its pages through
recorder.py, and the sidecar publishes them (kvstore/kv_events/publisher.py).
"""
from __future__ import annotations

import sys
import time
from array import array
from dataclasses import dataclass, field
from typing import Any, Union

import msgpack

MEDIUM_GPU = "GPU"
MEDIUM_CPU = "CPU"
MEDIUM_STORAGE = "STORAGE"
LOCAL = "LOCAL"
REMOTE = "REMOTE"

# A store tier -> (medium, locality) of the events about its copies.
TIER_MEDIA: dict[str, tuple[str, str]] = {
    "gpu": (MEDIUM_GPU, LOCAL),
    "cpu": (MEDIUM_CPU, LOCAL),
    "disk": (MEDIUM_STORAGE, LOCAL),
    "redis": (MEDIUM_STORAGE, REMOTE),
}

BlockHash = Union[bytes, int]
HASH_MASK = (1 << 64) - 1


def check_endpoints(endpoint: object, replay_endpoint: object) -> None:
    """The publisher's ZeroMQ addresses, as a config gives them. ValueError names the field."""
    for name, value in (("kv_events_endpoint", endpoint), ("kv_events_replay_endpoint", replay_endpoint)):
        if value is not None and (not isinstance(value, str) or "://" not in value):
            raise ValueError(f"{name}: expected a ZeroMQ address like tcp://127.0.0.1:5557, got {value!r}")
    if replay_endpoint is not None and endpoint is None:
        raise ValueError("kv_events_replay_endpoint: replays need kv_events_endpoint too")


def block_hash(page_key: bytes) -> int:
    """A page key as the 64-bit block hash routers index by: vLLM's own conversion of its block
    hashes (`maybe_convert_block_hash`, on by default), the key's last 8 bytes, big-endian."""
    return int.from_bytes(page_key, "big") & HASH_MASK


@dataclass(frozen=True)
class BlockStored:
    block_hashes: list[BlockHash]
    parent_block_hash: BlockHash | None
    token_ids: list[int]
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    extra_keys: list[tuple[Any, ...] | None] | None = None
    group_idx: int | None = None
    kv_cache_spec_kind: str | None = None
    kv_cache_spec_sliding_window: int | None = None
    locality: str | None = None
    ownership: str | None = None
    session_id: str | None = None


@dataclass(frozen=True)
class BlockRemoved:
    block_hashes: list[BlockHash]
    medium: str | None = None
    group_idx: int | None = None
    locality: str | None = None
    ownership: str | None = None


@dataclass(frozen=True)
class AllBlocksCleared:
    pass


KVEvent = Union[BlockStored, BlockRemoved, AllBlocksCleared]


@dataclass(frozen=True)
class KVEventBatch:
    ts: float
    events: list[KVEvent] = field(default_factory=list)
    data_parallel_rank: int | None = None


# Per event type: the fields vLLM writes always (no default there), then those it omits at None.
_ALWAYS = {"BlockStored": ("block_hashes", "parent_block_hash", "token_ids", "block_size", "lora_id", "medium",
                           "lora_name"),
           "BlockRemoved": ("block_hashes", "medium"),
           "AllBlocksCleared": ()}
_OPTIONAL = {"BlockStored": ("extra_keys", "group_idx", "kv_cache_spec_kind", "kv_cache_spec_sliding_window",
                             "locality", "ownership", "session_id"),
             "BlockRemoved": ("group_idx", "locality", "ownership"),
             "AllBlocksCleared": ()}
_TYPES: dict[str, type] = {"BlockStored": BlockStored, "BlockRemoved": BlockRemoved,
                           "AllBlocksCleared": AllBlocksCleared}


def event_to_wire(event: KVEvent) -> dict[str, Any]:
    kind = type(event).__name__
    wire: dict[str, Any] = {"type": kind}
    for name in _ALWAYS[kind]:
        wire[name] = getattr(event, name)
    for name in _OPTIONAL[kind]:
        value = getattr(event, name)
        if value is not None:
            wire[name] = value
    return wire


def encode_batch(batch: KVEventBatch) -> bytes:
    """The msgpack payload vLLM's `ZmqEventPublisher` sends for `batch`."""
    return encode_wire(batch.ts, [event_to_wire(e) for e in batch.events], batch.data_parallel_rank)


def encode_wire(ts: float, events: list[dict[str, Any]], data_parallel_rank: int | None) -> bytes:
    """A batch payload from events already in their wire form (`event_to_wire`)."""
    return msgpack.packb([ts, events, data_parallel_rank], use_bin_type=True)


def decode_batch(payload: bytes) -> KVEventBatch:
    """A payload from vLLM or kvstore; unknown fields are ignored, unknown event types refused."""
    try:
        ts, events, *rest = msgpack.unpackb(payload, raw=False, use_list=True, strict_map_key=False)
    except (ValueError, TypeError, msgpack.ExtraData, msgpack.FormatError, msgpack.StackError) as exc:
        raise ValueError(f"KV event batch: not a msgpack [ts, events, rank] array ({exc})") from None
    decoded: list[KVEvent] = []
    for wire in events:
        kind = wire.get("type") if isinstance(wire, dict) else None
        # A type that is not a string (a list, a map) is unknown too, not a TypeError from the lookup.
        if not isinstance(kind, str) or kind not in _TYPES:
            raise ValueError(f"KV event batch: unknown event type {kind!r}")
        cls = _TYPES[kind]
        known = _ALWAYS[kind] + _OPTIONAL[kind]
        args = {name: wire.get(name) for name in known}
        if kind == "BlockStored" and isinstance(args.get("extra_keys"), list):
            args["extra_keys"] = [tuple(k) if isinstance(k, list) else k for k in args["extra_keys"]]
        decoded.append(cls(**args))
    return KVEventBatch(float(ts), decoded, rest[0] if rest else None)


def token_list(tokens: bytes) -> list[int]:
    """A page's token ids (int32 little-endian bytes, docs/design.md §2) as ints."""
    ids = array("i", tokens)
    if sys.byteorder == "big":
        ids.byteswap()
    return ids.tolist()


def now_s() -> float:
    return time.time()
