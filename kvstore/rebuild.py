"""Rebuilding the page tree from the disk tier at start, so a restart keeps the disk cache.

Only record headers are read (the disk tier's `scan`), never payloads. Parents are inserted
before children; the pages come back as held by "disk" only, least recently used of all.
"""
from __future__ import annotations

import logging
from typing import Any

from kvstore.config import DTYPE_BYTES
from kvstore.index import PageIndex
from kvstore.keys import page_key
from kvstore.placement import Placement
from kvstore.registry import ModelRegistry
from kvstore.tiers.base import PageRecord
from kvstore.tiers.disk_cost import disk_record_cost

log = logging.getLogger("kvstore.store")


def rebuild_index(index: PageIndex, placement: Placement, registry: ModelRegistry, disk: Any) -> None:
    """Re-create the tree from the disk tier's headers, parents before children; delete
    records whose chain is broken (orphans can never be matched) or whose key does not hash
    from their parent and tokens."""
    records = {r.key: r for r in disk.scan()}
    depth: dict[bytes, int] = {}

    def depth_of(key: bytes) -> int:
        chain = []
        while key in records and key not in depth:
            chain.append(key)
            key = records[key].parent
        base = depth.get(key, -1)
        for k in reversed(chain):
            base += 1
            depth[k] = base
        return depth[chain[0]] if chain else depth.get(key, -1)

    for key in records:
        depth_of(key)
    loaded = orphans = 0
    for key in sorted(records, key=depth.__getitem__):
        record = records[key]
        parent = index.get(record.parent)
        if parent is None:
            is_root = record.parent == record.namespace if record.kind == "page" else record.parent not in records
            if not is_root:
                orphans += 1
                disk.delete(key)
                continue
            parent = index.root(record.parent, record.namespace)
        if page_key(parent.key, record.tokens) != key or (parent.parent is not None and parent.num_tokens == 0):
            orphans += 1
            disk.delete(key)
            continue
        spec = registry.specs_by_namespace.get(record.namespace)
        tail = record.num_tokens < spec.page_size if spec else record.num_tokens < parent.num_tokens
        node = index.insert(parent, key, record.tokens, tail=tail)
        node.ready = True
        codec_bytes = _record_payload_bytes(record)
        placement.add(node, "disk", disk_record_cost(codec_bytes, record.num_tokens))
        loaded += 1
    if loaded or orphans:
        log.info("disk tier: %d pages loaded into the index, %d orphaned records deleted", loaded, orphans)
    placement.make_room("disk", 0)  # a smaller disk_bytes than last time: evict to fit


def _record_payload_bytes(record: PageRecord) -> int:
    """Decoded size of a record's KV: the disk accounting's estimate after a restart."""
    size = DTYPE_BYTES.get(record.dtype, 2)
    for dim in record.shape:
        size *= dim
    return size
