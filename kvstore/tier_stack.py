"""The tier stack: the configured tiers, their codecs, and every byte copy between them.

`Placement` decides *which* page goes *where*; this module does the moving: allocating and
filling slots, encoding records, decoding a page out of whichever tier holds it, copying a page
down a tier (it is the `TierMover` that `Placement` calls) or into a slot of the top tier on a
hit, and the byte cost of a page in each tier. It holds no reference to placement and never
evicts: where a slot tier has no slot for a page (`allocate` raises TierFull), the caller, on
placement's side, evicts and asks again (kvstore/page_moves.py, `Placement.evicting_while_full`).
Callers hold the store lock for everything that changes placement; `put_page` on an allocated
slot, `read_page` and `record_batches` run outside it on pinned pages.

Top to bottom, the tiers of `TIER_TYPES` the config asks for: gpu (if `gpu_bytes`), cpu (if
`cpu_bytes`), disk (if `disk_bytes`), redis (if `redis_url`). Every tier is driven through the
interface of tiers/base.py only; the stack keeps them by kind (`slot_tiers`, `record_tiers`), and
the one branch between slot tiers (encoded pages in preallocated slots) and record tiers
(self-describing records) is in `put_page` and `slot`. A slot is a byte range of its tier's
buffer (tiers/base.py `Slot`); in a tier that keeps raw pages in host memory (`raw_buffers`) the
store copies a page's bytes with numpy, anywhere else through the tier's codec and `view`.
"""
from __future__ import annotations

import warnings
from functools import partial
from typing import Any, Iterator, Literal

import numpy as np
import torch

from kvstore.codecs import Codec, get_codec
from kvstore.gpu.dtypes import KV_DTYPES, NUMPY_DTYPES
from kvstore.config import CODECS as CODEC_NAMES
from kvstore.config import ModelSpec, StoreConfig
from kvstore.index import Node
from kvstore.registry import ModelRegistry
from kvstore.tiers.base import UNBOUNDED_BYTES, WRITTEN, PageRecord, RecordTier, Slot, SlotTier, Tier, WriteTicket
from kvstore.tiers.cpu import CPUTier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.gpu import GPUTier
from kvstore.tiers.redis import RedisTier
from kvstore.tiers.redis_landing import Landing

# Every kind of tier, top first: each builds itself from the config (or is absent).
TIER_TYPES: tuple[type[Tier], ...] = (GPUTier, CPUTier, DiskTier, RedisTier)

READ_BATCH_BYTES = 4 << 20  # a batching record tier (Redis) reads up to this much per round trip:
# many small pages share one; big pages go a few at a time (redis-py parses huge pipelined
# replies slower than single ones), and the tier reads the next batches ahead while this one
# is decoded


class TierStack:
    def __init__(self, config: StoreConfig, registry: ModelRegistry):
        self.config = config
        self.registry = registry
        self.tiers: dict[str, Tier] = {}  # by name, top first
        self.slot_tiers: dict[str, SlotTier] = {}  # the same tiers by kind
        self.record_tiers: dict[str, RecordTier] = {}
        self.codecs: dict[str, Codec] = {}
        for tier_type in TIER_TYPES:
            tier = tier_type.from_config(config)
            if tier is None:
                continue
            self.tiers[tier.name] = tier
            self.codecs[tier.name] = get_codec(tier.codec)
            if isinstance(tier, SlotTier):
                self.slot_tiers[tier.name] = tier
            else:
                assert isinstance(tier, RecordTier), f"{tier.name}: a tier is a SlotTier or a RecordTier"
                self.record_tiers[tier.name] = tier
        self.capacities = [(name, tier.fillable_bytes) for name, tier in self.tiers.items()]  # top first
        self.order = list(self.tiers)  # the tiers' names, top first (placement's order)
        self._sizes: dict[tuple[ModelSpec, int, str, bool], int] = {}
        # A page's bytes by (its namespace, its tokens' bytes, tier, without the codec), in front
        # of `size_for`'s memo: placement asks on every add and discard, and a spec's hash is a
        # Python call. A namespace stands for one spec for good (its key hashes the whole spec,
        # and the registry only ever adds to `specs_by_namespace`), so an entry never goes stale.
        self._page_sizes: dict[tuple[bytes, int, str, bool], int] = {}
        self.top = self.capacities[0][0]
        # The tier that survives a restart (the index is rebuilt from it; close and
        # write-through write it), and the one other sidecars share; None where there is none.
        self.persistent = next((name for name, tier in self.tiers.items() if tier.persistent), None)
        self.shared: RecordTier | None = next((tier for tier in self.record_tiers.values() if tier.shared), None)
        # Only slot tiers: an eviction drops a page, it never waits on a record tier's writes.
        self.memory_only = not self.record_tiers
        # The tiers that lose copies on their own (corrupt records, failed writes, Redis
        # evictions): record tiers; a slot is only ever freed by the store.
        self.losing = list(self.record_tiers.items())
        # The buffers, as flat numpy uint8 arrays, of the slot tiers in host memory that keep
        # pages raw (codec "none"): the store copies their pages at their slots' ranges with
        # numpy, no codec and no torch view on the way.
        self.raw_buffers: dict[str, np.ndarray] = {
            name: tier.buffer_array for name, tier in self.slot_tiers.items()
            if tier.buffer_array is not None and self.codecs[name].name == "none"}

    def close(self) -> None:
        for tier in reversed(self.tiers.values()):  # record tiers first: their writers drain
            tier.close()

    def flush(self, timeout_s: float | None = None) -> bool:
        return all(tier.flush(timeout_s) for tier in self.tiers.values())

    def slot(self, tier: str, key: bytes) -> Slot | None:
        """The slot holding page `key` in a slot tier; None in a record tier (read a record)."""
        holder = self.slot_tiers.get(tier)
        return holder.get(key) if holder is not None else None

    def raw_page(self, spec: ModelSpec, tier: str, slot: Slot, num_tokens: int) -> np.ndarray | None:
        """The page of `num_tokens` in `slot` of a raw host tier (`raw_buffers`) as a numpy view of
        the slot itself, KV (L, 2, n, H, D) as gpu/dtypes.py NUMPY_DTYPES holds it; None for any
        other tier."""
        buffer = self.raw_buffers.get(tier)
        if buffer is None:
            return None
        offset = slot[0]
        return buffer[offset:offset + spec.bytes_per_token * num_tokens].view(NUMPY_DTYPES[spec.dtype]) \
            .reshape(spec.kv_shape(num_tokens))

    def keeps_slots(self, tier: str) -> bool:
        return tier in self.slot_tiers

    def source_tier(self, node: Node) -> str:
        """The top tier holding `node`: where it is read from."""
        for tier in self.order:
            if tier in node.tiers:
                return tier
        raise AssertionError(f"{node} is in the tree but in no tier")

    def allocate(self, tier: str, key: bytes, nbytes: int) -> Slot:
        """A slot of `nbytes` for page `key` in a slot tier. Raises TierFull when none is free
        although placement counts room (the slab is cut for other page sizes): placement evicts
        one more page and asks again."""
        return self.slot_tiers[tier].allocate(key, nbytes)

    def put_page(self, spec: ModelSpec, node: Node, tier: str, *, kv: torch.Tensor | None = None,
                 payload: torch.Tensor | None = None, slot: Slot | None = None) -> WriteTicket | None:
        """Write `node`'s page into `tier`, where room is made: encoded from `kv` (L, 2, n, H, D),
        or `payload`, its bytes already in the tier's codec. A slot tier takes it in `slot` (one
        is allocated here when None); a record tier gets a record. The write's ticket (a slot's
        is set already). Raises TierFull when `slot` is None and a slot tier has none free."""
        record_tier = self.record_tiers.get(tier)
        if record_tier is not None:
            return record_tier.put(self.record(spec, node, tier, kv=kv, payload=payload))
        if slot is None:
            slot = self.allocate(tier, node.key, self.size_in(node, tier))
        codec = self.codecs[tier]
        dst = self.slot_tiers[tier].view(slot, codec.encoded_bytes(spec, node.num_tokens))
        if payload is not None:
            dst.copy_(payload)
        else:
            assert kv is not None, "put_page: kv or payload"
            codec.encode(spec, kv, dst)
        return WRITTEN

    def record(self, spec: ModelSpec, node: Node, tier: str, *, kv: torch.Tensor | None = None,
                payload: torch.Tensor | None = None) -> PageRecord:
        """A record of `node` for a record tier, from its KV (encoded here) or its encoded bytes."""
        codec = self.codecs[tier]
        n = node.num_tokens
        if payload is None:
            assert kv is not None, "record: kv or payload"
            payload = torch.empty(codec.encoded_bytes(spec, n), dtype=torch.uint8)
            codec.encode(spec, kv, payload)
        parent = node.parent
        assert parent is not None, "a root is never stored"
        return PageRecord(namespace=node.namespace, key=node.key, parent=parent.key,
                          tokens=node.tokens, codec=codec.name, dtype=spec.dtype, shape=spec.kv_shape(n),
                          payload=payload, kind="page" if node.root.key == node.namespace else "chunk")

    def fill_slot(self, spec: ModelSpec, node: Node, tier: str, slot: Slot, kv: torch.Tensor | np.ndarray) -> None:
        """Write `node`'s page into its allocated `slot` of `tier` (a hit promoted there). `kv`:
        its KV (L, 2, n, H, D) as a tensor, or as a numpy view of the fetch answer (gpu/dtypes.py
        NUMPY_DTYPES), which a tier in `raw_buffers` takes with one numpy copy."""
        buffer = self.raw_buffers.get(tier)
        if isinstance(kv, np.ndarray):
            if buffer is not None:
                offset = slot[0]
                np.copyto(buffer[offset:offset + kv.nbytes].view(kv.dtype).reshape(kv.shape), kv, casting="no")
                return
            kv = torch.from_numpy(kv).view(KV_DTYPES[spec.dtype])  # bfloat16 is held as int16
        self.put_page(spec, node, tier, kv=kv, slot=slot)

    def record_batches(self, reads: list, spec: ModelSpec | None = None, out: torch.Tensor | np.ndarray | None = None,
                       start: int = 0) -> Iterator[dict[bytes, PageRecord | None]]:
        """Records of the reads served by record tiers, in order, one dict per batch. A tier
        that batches (Redis: `read_ahead`, pipelined, the next batches in flight while the
        caller decodes this one; disk: one read transaction a batch) gets runs of up to
        READ_BATCH_BYTES; others one page a call. `out` (L, 2, T, H, D), a tensor or its numpy
        array, the answer from token `start` on: a batching tier puts the uncompressed payload
        of a page read whole straight into its place there (received from the socket, copied
        out of the LMDB map); its record comes back with that `Landing` as payload. Such a
        page's place in `out` holds garbage if its record is lost: the caller serves only up to
        the first lost page. Outside the lock: the pages are pinned."""
        runs: list[tuple[str, list[list[bytes]]]] = []  # (tier, batches of keys), in read order
        landings: dict[bytes, Landing] = {}
        answer = None
        if spec is not None and out is not None:
            answer = _answer_rows(spec, out)
            # A page's slice of a row of the answer: its tokens' H * D * itemsize bytes each.
            slice_token_bytes = spec.bytes_per_token // (2 * spec.num_layers)
        nbytes = 0
        for node, first, used, tier, slot in reads:
            if slot is not None:
                continue
            batching = self.record_tiers[tier].batched_reads
            if batching and spec is not None and answer is not None and first >= start and used == node.num_tokens:
                # Where its uncompressed payload (L, 2, n, H, D) goes: of every row of the answer,
                # the bytes of its tokens (first - start .. + n).
                lo = (first - start) * slice_token_bytes
                landings[node.key] = Landing(answer[:, lo:lo + used * slice_token_bytes],
                                             partial(_lands_raw, spec, node))
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
            yield from record_tier.read_ahead(batches, landings if record_tier.batched_reads else None)

    def read_page(self, spec: ModelSpec, node: Node, tier: str, slot: Slot | None,
                  record: PageRecord | None, whole: bool, out: torch.Tensor) -> torch.Tensor | Literal[True] | None:
        """Decode one page from its slot or its record. True: decoded straight into `out`; a
        tensor: the whole page (L, 2, n, H, D) for the caller to slice; None: the page is gone
        (a miss from here). A record must carry the node's token ids (a shared tier's key is
        found by hash: a collision or a foreign value is a miss, never wrong KV)."""
        codec = self.codecs[tier]
        n = node.num_tokens
        if slot is not None:
            data = self.slot_tiers[tier].view(slot, codec.encoded_bytes(spec, n))
        else:
            if record is None:
                return None
            if record.payload.__class__ is Landing:  # landed in `out` by record_batches, whose
                assert whole, "record_batches lands only pages read whole"  # accepts checked
                return True  # the header against this node (`_lands_raw`)
            if not _describes(spec, node, record):
                return None
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
        page = torch.empty(spec.kv_shape(n), dtype=KV_DTYPES[spec.dtype], device=out.device)  # (L, 2, n, H, D)
        codec.decode(spec, data, n, page)
        return page

    # -- TierMover: Placement calls these under the store lock ---------------------------
    def copy_down(self, node: Node, src: str, dst: str) -> bool:
        """Copy the page from tier `src` into `dst`, where placement made room. False: it could
        not be read or encoded; raises TierFull when slot tier `dst` has no slot free for it."""
        spec = self.registry.specs_by_namespace.get(node.namespace)
        if spec is None:
            return False
        n = node.num_tokens
        source, target = self.slot_tiers.get(src), self.slot_tiers.get(dst)
        if source is not None and source.encodes_on_device:
            # Encode on the device (quantizing there when the lower tier's codec asks for it),
            # then copy to the host: only the compact bytes cross PCIe, and a record tier gets
            # host bytes (its writer reads a payload in place; device memory it cannot).
            codec = self.codecs[dst]
            nbytes = codec.encoded_bytes(spec, n)
            if target is None:
                payload = torch.empty(nbytes, dtype=torch.uint8)
                source.copy_out(node.key, spec, n, codec, payload).synchronize()
                return self.put_page(spec, node, dst, payload=payload) is not None
            slot = self.allocate(dst, node.key, self.size_in(node, dst))
            source.copy_out(node.key, spec, n, codec, target.view(slot, nbytes)).synchronize()
            return True
        if source is not None:
            held = source.get(node.key)
            assert held is not None, f"{node} is in {src} but has no slot there"
            data = source.view(held, self.codecs[src].encoded_bytes(spec, n))
        else:
            record = self.record_tiers[src].get(node.key)
            if record is None:
                return False
            data = byte_tensor(record.payload)
        if self.codecs[src].name == self.codecs[dst].name:
            # Same encoding below: hand the bytes down as they are (one copy, no re-encode).
            return self.put_page(spec, node, dst, payload=data.clone()) is not None
        kv = torch.empty(spec.kv_shape(n), dtype=KV_DTYPES[spec.dtype])  # (L, 2, n, H, D)
        self.codecs[src].decode(spec, data.cpu(), n, kv)
        return self.put_page(spec, node, dst, kv=kv) is not None

    def release(self, node: Node, tier: str) -> None:
        self.tiers[tier].delete(node.key)

    # -- sizes ---------------------------------------------------------------------------
    def size_in(self, node: Node, tier: str) -> int:
        # Unknown model: it cannot be decoded, so it is never copied anywhere.
        return self._page_size(node, tier, False, UNBOUNDED_BYTES)

    def raw_size_in(self, node: Node, tier: str) -> int:
        # Unknown model: pages on disk of a model nobody registered since the restart.
        return self._page_size(node, tier, True, 0)

    def _page_size(self, node: Node, tier: str, raw: bool, unknown: int) -> int:
        """`size_for` the page's spec, or what `tier` holds of it (else `unknown`) when its
        model is not registered."""
        key = (node.namespace, len(node.tokens), tier, raw)
        size = self._page_sizes.get(key)
        if size is None:
            spec = self.registry.specs_by_namespace.get(node.namespace)
            if spec is None:
                return node.tiers.get(tier, unknown)
            size = self._page_sizes[key] = self.size_for(spec, node.num_tokens, tier, raw=raw)
        return size

    def size_for(self, spec: ModelSpec, num_tokens: int, tier: str, *, raw: bool = False) -> int:
        """Bytes a page of `num_tokens` takes in `tier` (`raw`: without the tier's codec).
        Memoized: placement asks on every add, discard and demotion."""
        key = (spec, num_tokens, tier, raw)
        size = self._sizes.get(key)
        if size is None:
            codec = get_codec("none") if raw else self.codecs[tier]
            size = self._sizes[key] = self.tiers[tier].cost_bytes(spec, codec, num_tokens)
        return size


def _describes(spec: ModelSpec, node: Node, record: PageRecord) -> bool:
    """The record is `node`'s page: a shared tier's key is found by hash, so a collision or a
    foreign value must be a miss, never wrong KV."""
    return record.shape == spec.kv_shape(node.num_tokens) and bytes(record.tokens) == node.tokens


def _lands_raw(spec: ModelSpec, node: Node, record: PageRecord) -> bool:
    """A record header whose payload may go straight into the answer: `node`'s page (what
    `_describes` tests, spelled out: this runs once a page on every landed read), its payload the
    raw KV bytes (L, 2, n, H, D) in the answer's dtype."""
    return (record.codec == "none" and record.dtype == spec.dtype and record.tokens == node.tokens
            and record.shape == spec.kv_shape(node.num_tokens))


def _answer_rows(spec: ModelSpec, out: torch.Tensor | np.ndarray) -> np.ndarray | None:
    """A fetch answer (L, 2, T, H, D) (a tensor, or its numpy array: cheaper to view) as writable
    uint8 rows (L x 2, T * H * D * itemsize), one a layer and K or V; None where payloads cannot
    be received into it (on a GPU, or not one contiguous block)."""
    if isinstance(out, np.ndarray):
        if not out.flags.c_contiguous or out.size == 0:
            return None
        return out.reshape(2 * spec.num_layers, -1).view(np.uint8)
    if out.device.type != "cpu" or not out.is_contiguous() or out.numel() == 0:
        return None
    return out.view(-1).view(torch.uint8).numpy().reshape(2 * spec.num_layers, -1)


def byte_tensor(payload: Any) -> torch.Tensor:
    """A uint8 tensor over a record payload, without copying (payloads are only read)."""
    if isinstance(payload, torch.Tensor):
        return payload
    if isinstance(payload, memoryview) and not payload.readonly:
        # A Redis value's payload (a view of the buffer it was received into): torch warns only
        # about read-only buffers, and entering catch_warnings costs more than the wrap itself.
        return torch.frombuffer(payload, dtype=torch.uint8)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # read-only buffers: we never write them
        return torch.frombuffer(payload, dtype=torch.uint8)
