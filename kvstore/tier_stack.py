"""The tier stack: the configured tiers, their codecs, and every byte copy between them.

`KVStore` decides (with `Placement`) *which* page goes *where*; this module does the moving:
reserving and filling slots, encoding records, decoding a page out of whichever tier holds it,
copying a page down a tier (it is the `TierMover` that `Placement` calls) or up into the top tier
on a hit, and the byte cost of a page in each tier. Callers hold the store lock for everything
that changes placement; `read_page` and `record_batches` run outside it on pinned pages.

Top to bottom: gpu (if `gpu_bytes`), cpu (if `cpu_bytes`), disk (if `disk_bytes`), redis (if
`redis_url`). Slot tiers (gpu, cpu) hold encoded pages in preallocated slots; record tiers
(disk, redis) hold self-describing records.
"""
from __future__ import annotations

import logging
import os
import threading
import warnings
from functools import partial
from typing import Any, Iterator

import torch

from kvstore.codecs import TORCH_DTYPES, Codec, get_codec
from kvstore.config import CODECS as CODEC_NAMES
from kvstore.config import ModelSpec, StoreConfig
from kvstore.copy import NUMPY_DTYPES
from kvstore.index import Node, PageIndex
from kvstore.placement import Placement
from kvstore.registry import ModelRegistry
from kvstore.tiers.base import PageRecord, TierFull
from kvstore.tiers.cpu import CPUTier
from kvstore.tiers.disk_cost import disk_record_cost
from kvstore.tiers.redis_landing import Landing

log = logging.getLogger("kvstore.store")

DISK_FILL_FRACTION = 0.9  # LMDB needs room for its own pages beyond the records:
LMDB_RESERVED_BYTES = 128 << 10  # 10% for B-tree pages and the free list, plus its meta pages
READ_BATCH_BYTES = 4 << 20  # a batching record tier (Redis) reads up to this much per round trip:
# many small pages share one; big pages go a few at a time (redis-py parses huge pipelined
# replies slower than single ones), and the tier reads the next batches ahead while this one
# is decoded


class TierStack:
    def __init__(self, config: StoreConfig, registry: ModelRegistry):
        self.config = config
        self.registry = registry
        self.placement: Placement  # set by the store once placement exists (it needs this mover)
        self.slot_tiers: dict[str, Any] = {}
        self.record_tiers: dict[str, Any] = {}
        self.codecs: dict[str, Codec] = {}
        capacities: list[tuple[str, int]] = []
        if config.gpu_bytes:
            from kvstore.tiers.gpu import GPUTier  # raises a clear error without a usable GPU

            self.slot_tiers["gpu"] = GPUTier(config.gpu_bytes)
            self.codecs["gpu"] = get_codec("none")
            capacities.append(("gpu", config.gpu_bytes))
        if config.cpu_bytes:
            self.slot_tiers["cpu"] = CPUTier(config.cpu_bytes)
            self.codecs["cpu"] = get_codec(config.cpu_codec)
            capacities.append(("cpu", config.cpu_bytes))
        if config.disk_bytes:
            from kvstore.tiers.disk import DiskTier

            self.record_tiers["disk"] = DiskTier(
                os.path.join(config.data_dir, "pages"), config.disk_bytes,  # type: ignore[arg-type]
                compression=config.disk_compression, zstd_level=config.zstd_level,
                sync=config.durability == "write-through", queue_pages=config.disk_writer_queue)
            self.codecs["disk"] = get_codec(config.disk_codec)
            # The tier's capacity, not disk_bytes: it is smaller on a filesystem with less room.
            disk_capacity = self.record_tiers["disk"].capacity_bytes
            capacities.append(("disk", max(0, int(disk_capacity * DISK_FILL_FRACTION) - LMDB_RESERVED_BYTES)))
        if config.redis_url:
            from kvstore.tiers.redis import RedisTier

            self.record_tiers["redis"] = RedisTier(config)
            self.codecs["redis"] = get_codec(config.disk_codec)
            capacities.append(("redis", 1 << 62))  # Redis' own maxmemory policy bounds it
        self.capacities = capacities  # (tier, bytes the store may fill), top first
        self._sizes: dict[tuple[ModelSpec, int, str, bool], int] = {}
        self.top = capacities[0][0]

    def close(self) -> None:
        for tier in list(self.record_tiers.values()) + list(self.slot_tiers.values()):
            tier.close()

    def source_tier(self, node: Node) -> str:
        for tier in self.placement.order:
            if tier in node.tiers:
                return tier
        raise AssertionError(f"{node} is in the tree but in no tier")

    def reserve(self, spec: ModelSpec, key: bytes, n: int,
                namespace: bytes | None = None) -> tuple[str | None, int, torch.Tensor | None]:
        """Room for a new page of `namespace` (its tenant's quota holds) in the top tier that has
        it: (tier, bytes, slot or None)."""
        for tier in self.placement.order:
            nbytes = self.size_for(spec, n, tier)
            if not self.placement.make_room(tier, nbytes, namespace):
                continue
            if tier in self.slot_tiers:
                slot = self.allocate(tier, key, nbytes)
                if slot is None:
                    continue
                return tier, nbytes, slot
            return tier, nbytes, None
        return None, 0, None

    def allocate(self, tier: str, key: bytes, nbytes: int) -> torch.Tensor | None:
        """A slot in a slot tier; evicts more when the slab is fragmented across page sizes."""
        while True:
            try:
                return self.slot_tiers[tier].allocate(key, nbytes)
            except TierFull:
                if not self.placement.evict_one(tier):
                    return None

    def write_through(self, spec: ModelSpec, node: Node, kv: torch.Tensor) -> threading.Event | None:
        if "disk" in node.tiers:
            return None
        nbytes = self.size_in(node, "disk")
        if not self.placement.make_room("disk", nbytes):
            return None
        event = self.record_tiers["disk"].put(self.record(spec, node, "disk", kv=kv))
        self.placement.add(node, "disk", nbytes)
        return event

    def record(self, spec: ModelSpec, node: Node, tier: str, *, kv: torch.Tensor | None = None,
                payload: torch.Tensor | None = None) -> PageRecord:
        """A record of `node` for a record tier, from its KV (encoded here) or its encoded bytes."""
        codec = self.codecs[tier]
        n = node.num_tokens
        if payload is None:
            assert kv is not None
            payload = torch.empty(codec.encoded_bytes(spec, n), dtype=torch.uint8)
            codec.encode(spec, kv, payload)
        return PageRecord(namespace=node.namespace, key=node.key, parent=node.parent.key,  # type: ignore[union-attr]
                          tokens=node.tokens, codec=codec.name, dtype=spec.dtype, shape=spec.kv_shape(n),
                          payload=payload, kind="page" if node.root.key == node.namespace else "chunk")

    def promote(self, spec: ModelSpec, node: Node, kv: torch.Tensor) -> None:
        """Copy a page served by a lower tier into the top tier (under the lock)."""
        top = self.top
        if top in node.tiers or top not in self.slot_tiers or not node.ready:
            return
        nbytes = self.size_in(node, top)
        if not self.placement.make_room(top, nbytes, node.namespace):
            return
        slot = self.allocate(top, node.key, nbytes)
        if slot is None:
            return
        self.codecs[top].encode(spec, kv, slot[:self.codecs[top].encoded_bytes(spec, node.num_tokens)])
        self.placement.add(node, top, nbytes)
        self.placement.usage[top].promotions += 1

    def record_batches(self, reads: list, spec: ModelSpec | None = None, out: torch.Tensor | None = None,
                       start: int = 0) -> Iterator[dict[bytes, PageRecord | None]]:
        """Records of the reads served by record tiers, in order, one dict per batch. A tier
        that batches (Redis: `read_ahead`, pipelined, the next batches in flight while the
        caller decodes this one) gets runs of up to READ_BATCH_BYTES; others one page a call.
        `out` (L, 2, T, H, D), the answer from token `start` on: a batching tier receives the
        uncompressed payload of a page read whole straight into its place there (no copy out
        of a receive buffer); `read_page` then finds it done. Such a page's place in `out`
        holds garbage if its record is lost: the caller serves only up to the first lost page.
        Outside the lock: the pages are pinned."""
        runs: list[tuple[str, list[list[bytes]]]] = []  # (tier, batches of keys), in read order
        landings: dict[bytes, Landing] = {}
        answer = _answer_bytes(out) if spec is not None and out is not None else None
        nbytes = 0
        for node, first, used, tier, slot in reads:
            if slot is not None:
                continue
            batching = hasattr(self.record_tiers[tier], "read_ahead")
            if batching and answer is not None and first >= start and used == node.num_tokens:
                landings[node.key] = self._landing(spec, node, answer, out.shape[2], first - start)  # type: ignore[arg-type, union-attr]
            if not runs or runs[-1][0] != tier or not batching:
                runs.append((tier, [[]]))
                nbytes = 0
            elif nbytes >= READ_BATCH_BYTES:
                runs[-1][1].append([])
                nbytes = 0
            runs[-1][1][-1].append(node.key)
            nbytes += node.tiers.get(tier, 0)
        for tier, batches in runs:
            record_tier = self.record_tiers[tier]
            if hasattr(record_tier, "read_ahead"):
                yield from record_tier.read_ahead(batches, landings)
            else:
                yield {batches[0][0]: record_tier.get(batches[0][0])}

    def slot_array(self, spec: ModelSpec, tier: str, slot: torch.Tensor, num_tokens: int) -> Any:
        """A slot that holds its page raw (codec "none") in host memory, as a numpy view of the
        page's KV (L, 2, n, H, D): the store copies whole pages in and out of it with numpy
        (kvstore/copy.py `host_array`, whose dtypes these are: bfloat16 as int16). None where the
        codec must encode or decode the page or the slot is on a GPU: use `read_page` and the
        codec's `encode`."""
        dtype = NUMPY_DTYPES.get(spec.dtype)
        if dtype is None or self.codecs[tier].name != "none" or not slot.is_cpu:
            return None
        return slot.numpy()[:num_tokens * spec.bytes_per_token].view(dtype).reshape(spec.kv_shape(num_tokens))

    def read_page(self, spec: ModelSpec, node: Node, tier: str, slot: torch.Tensor | None,
                   record: PageRecord | None, whole: bool, out: torch.Tensor) -> torch.Tensor | bool | None:
        """Decode one page from its slot or its record. True: decoded straight into `out`; a
        tensor: the whole page (L, 2, n, H, D) for the caller to slice; None: the page is gone
        (a miss from here). A record must carry the node's token ids (a shared tier's key is
        found by hash: a collision or a foreign value is a miss, never wrong KV)."""
        codec = self.codecs[tier]
        n = node.num_tokens
        if slot is not None:
            data = slot[:codec.encoded_bytes(spec, n)]
        else:
            if record is None or not _describes(spec, node, record):
                return None
            if isinstance(record.payload, Landing):  # received into `out` by record_batches
                assert whole, "record_batches lands only pages read whole"
                return True
            if record.codec != codec.name:  # sidecars sharing Redis may run different codecs
                if record.codec not in CODEC_NAMES:
                    return None
                codec = get_codec(record.codec)
            data = byte_tensor(record.payload)
            if data.numel() != codec.encoded_bytes(spec, n):
                return None
        if whole:
            codec.decode(spec, data, n, out)
            return True
        page = torch.empty(spec.kv_shape(n), dtype=TORCH_DTYPES[spec.dtype], device=out.device)  # (L, 2, n, H, D)
        codec.decode(spec, data, n, page)
        return page

    def _landing(self, spec: ModelSpec, node: Node, answer: memoryview, answer_tokens: int,
                 offset: int) -> Landing:
        """The L x 2 byte slices of the answer (L, 2, answer_tokens, H, D) that hold `node`'s
        KV from token `offset` on, in the order of an uncompressed payload (L, 2, n, H, D)."""
        slice_token_bytes = spec.bytes_per_token // (2 * spec.num_layers)  # H * D * itemsize
        row_bytes = answer_tokens * slice_token_bytes  # one (layer, K or V) of the answer
        lo = offset * slice_token_bytes
        hi = lo + node.num_tokens * slice_token_bytes
        chunks = tuple([answer[r:r + hi - lo] for r in range(lo, 2 * spec.num_layers * row_bytes, row_bytes)])
        return Landing(chunks, partial(_lands_raw, spec, node))

    # -- TierMover: Placement calls these under the store lock ---------------------------
    def copy_down(self, node: Node, src: str, dst: str) -> bool:
        spec = self.registry.specs_by_namespace.get(node.namespace)
        if spec is None:
            return False
        n = node.num_tokens
        if src == "gpu" and dst in self.slot_tiers:
            # Quantize on the device (when the lower tier's codec asks for it) before the
            # device->host copy: only the compact bytes cross PCIe.
            slot = self.allocate(dst, node.key, self.size_in(node, dst))
            if slot is None:
                return False
            codec = self.codecs[dst]
            self.slot_tiers["gpu"].copy_out(node.key, spec, n, codec, slot[:codec.encoded_bytes(spec, n)]).synchronize()
            return True
        if src in self.slot_tiers:
            data = self.slot_tiers[src].get(node.key)[:self.codecs[src].encoded_bytes(spec, n)]
        else:
            record = self.record_tiers[src].get(node.key)
            if record is None:
                return False
            data = byte_tensor(record.payload)
        if self.codecs[src].name == self.codecs[dst].name and dst in self.record_tiers:
            # Same encoding below: hand the bytes down as they are (one copy, no re-encode).
            self.record_tiers[dst].put(self.record(spec, node, dst, payload=data.clone()))
            return True
        kv = torch.empty(spec.kv_shape(n), dtype=TORCH_DTYPES[spec.dtype])  # (L, 2, n, H, D)
        self.codecs[src].decode(spec, data.cpu(), n, kv)
        if dst in self.record_tiers:
            self.record_tiers[dst].put(self.record(spec, node, dst, kv=kv))
            return True
        slot = self.allocate(dst, node.key, self.size_in(node, dst))
        if slot is None:
            return False
        self.codecs[dst].encode(spec, kv, slot[:self.codecs[dst].encoded_bytes(spec, n)])
        return True

    def release(self, node: Node, tier: str) -> None:
        if tier in self.slot_tiers:
            self.slot_tiers[tier].delete(node.key)
        else:
            self.record_tiers[tier].delete(node.key)

    # -- sizes ---------------------------------------------------------------------------
    def size_in(self, node: Node, tier: str) -> int:
        spec = self.registry.specs_by_namespace.get(node.namespace)
        if spec is None:  # unknown model: it cannot be decoded, so it is never copied anywhere
            return node.tiers.get(tier, 1 << 62)
        return self.size_for(spec, node.num_tokens, tier)

    def raw_size_in(self, node: Node, tier: str) -> int:
        spec = self.registry.specs_by_namespace.get(node.namespace)
        if spec is None:  # pages on disk of a model nobody registered since the restart
            return node.tiers.get(tier, 0)
        return self.size_for(spec, node.num_tokens, tier, raw=True)

    def size_for(self, spec: ModelSpec, num_tokens: int, tier: str, *, raw: bool = False) -> int:
        """Bytes a page of `num_tokens` takes in `tier` (`raw`: without the tier's codec).
        Memoized: placement asks on every add, discard and demotion."""
        key = (spec, num_tokens, tier, raw)
        size = self._sizes.get(key)
        if size is None:
            codec = get_codec("none") if raw else self.codecs[tier]
            if tier in self.slot_tiers:
                # Slots are sized for a full page, so tail pages and full pages share slots.
                size = self.slot_tiers[tier].slot_bytes(codec.encoded_bytes(spec, spec.page_size))
            else:
                size = disk_record_cost(codec.encoded_bytes(spec, num_tokens), num_tokens)
            self._sizes[key] = size
        return size

    def save_memory_pages(self, index: PageIndex) -> None:
        """Copy pages held only in memory tiers down to disk, parents first, while room lasts."""
        saved = 0
        for node in sorted(index.nodes.values(), key=lambda n: n.depth):
            if "disk" in node.tiers or not node.ready:
                continue
            if node.parent is not None and not node.parent.is_root and "disk" not in node.parent.tiers:
                continue  # its parent did not make it: the page could not be matched after restart
            nbytes = self.size_in(node, "disk")
            if not self.placement.fits("disk", nbytes):
                continue  # closing must not evict older disk pages for newer memory ones
            if self.copy_down(node, self.source_tier(node), "disk"):
                self.placement.add(node, "disk", nbytes)
                saved += 1
        if saved:
            log.info("close: %d memory-only pages written to disk", saved)


def _describes(spec: ModelSpec, node: Node, record: PageRecord) -> bool:
    """The record is `node`'s page: a shared tier's key is found by hash, so a collision or a
    foreign value must be a miss, never wrong KV."""
    return record.shape == spec.kv_shape(node.num_tokens) and bytes(record.tokens) == node.tokens


def _lands_raw(spec: ModelSpec, node: Node, record: PageRecord) -> bool:
    """A record header whose payload may go straight into the answer: `node`'s page, its
    payload the raw KV bytes (L, 2, n, H, D) in the answer's dtype."""
    return record.codec == "none" and record.dtype == spec.dtype and _describes(spec, node, record)


def _answer_bytes(out: torch.Tensor) -> memoryview | None:
    """A writable byte view of a fetch answer, or None where payloads cannot be received into
    it (on a GPU, or not one contiguous block)."""
    if out.device.type != "cpu" or not out.is_contiguous() or out.numel() == 0:
        return None
    return memoryview(out.view(-1).view(torch.uint8).numpy())


def byte_tensor(payload: Any) -> torch.Tensor:
    """A uint8 tensor over a record payload, without copying (payloads are only read)."""
    if isinstance(payload, torch.Tensor):
        return payload
    if isinstance(payload, memoryview) and not payload.readonly:
        # A Redis value's payload (a view of the buffer it was received into): torch warns only
        # about read-only buffers, and entering catch_warnings cost three times the wrap itself.
        return torch.frombuffer(payload, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers: we never write them
        return torch.frombuffer(payload, dtype=torch.uint8)
