"""The tier interface: what the store's tier stack (kvstore/tier_stack.py) calls on every tier.

Tiers know nothing of prefixes, policies or each other: the store decides what goes where, when
to evict, demote and promote; a tier only holds bytes. There are two kinds, one base class each
(`keeps_slots` says which), and the stack tells them apart by that, never by a tier's name:

- a **slot tier** (`SlotTier`: gpu, cpu) preallocates one flat uint8 `buffer` and hands out
  slots of it. A slot has one form, a `Slot`: its byte range (offset, nbytes) in `buffer`. The
  store encodes a page straight into its slot (`allocate`; one copy on the store path) and
  decodes from it (`get`; one copy on fetch), through `view(slot)`, a uint8 tensor of those
  bytes, or, for a buffer in host memory, through `buffer_array[offset:...]`, the same bytes as
  numpy: a numpy slice costs a fraction of a torch one, and slots that lie one after another are
  copied with one numpy call. A range is what both need, and making it costs nothing;
- a **record tier** (`RecordTier`: disk, redis) keeps self-describing records (`PageRecord`:
  header + payload + checksum), so it can rebuild the index after a restart and turn
  corruption into a miss. `put` queues a record and returns a `WriteTicket`.

What else a tier is to the store is a class attribute, not a name: `persistent` (the index is
rebuilt from it at start, close saves memory-only pages to it, write-through writes it),
`shared` (other sidecars write it: lookups probe it), `batched_reads` (it reads a batch of pages
at a time, Redis in one round trip, disk in one read transaction, and can land payloads in the
caller's buffers), `encodes_on_device` (a slot tier that encodes a page where it lives before it
leaves: `copy_out`, the GPU). Adding a tier is one module with a subclass of `SlotTier` or
`RecordTier` (and a `from_config`), and one entry in the stack's `TIER_TYPES`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Iterator, Mapping

import numpy as np
import torch

from kvstore.tiers.disk_cost import disk_record_cost

if TYPE_CHECKING:
    from kvstore.codecs import Codec
    from kvstore.config import ModelSpec, StoreConfig

# A page's slot in a slot tier: (offset, nbytes), the byte range of the tier's `buffer` that holds
# it (nbytes is the slot's size, rounded up to the tier's alignment: at least the page's encoded
# bytes). A plain tuple, the one the slot map keeps: handing it out builds nothing, and the fetch
# path unpacks one per page.
Slot = tuple[int, int]

# A capacity the store never fills: the tier bounds itself (Redis' maxmemory), and a page of an
# unknown model costs this much anywhere, so it is never copied.
UNBOUNDED_BYTES = 1 << 62


class TierFull(Exception):
    """The tier has no room for this page right now; the store evicts and retries."""


@dataclass(frozen=True)
class PageRecord:
    """A page as a record tier keeps it. `payload` is the codec-encoded KV of `num_tokens`."""

    namespace: bytes
    key: bytes
    parent: bytes  # parent page key; the namespace for a first page; b"" for a chunk
    tokens: bytes  # int32 little-endian token ids of this page
    codec: str
    dtype: str
    shape: tuple[int, ...]  # (L, 2, n, H, D) of the decoded KV
    payload: Any  # bytes-like (bytes, memoryview) or a uint8 torch tensor
    kind: str = "page"  # "page" (prefix tree) or "chunk" (CacheBlend, position-independent)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens) // 4

    def with_payload(self, payload: Any) -> "PageRecord":
        """This record carrying `payload`: the disk tier keeps each key's decoded header as a
        record without payload and answers every read with a copy of it. Built field by field:
        the frozen dataclass's __init__ (and `dataclasses.replace`) cost several times more."""
        record = object.__new__(PageRecord)
        fields = record.__dict__
        fields.update(self.__dict__)
        fields["payload"] = payload
        return record


class WriteTicket(threading.Event):
    """Set once a write is done or given up. `ok` is False when the tier knows the write failed
    (a full disk); a tier that learns of losses later reports them through `take_failed`."""

    ok = True


WRITTEN = WriteTicket()  # the ticket of a write that was done on the spot (a slot's copy)
WRITTEN.set()


class Tier:
    """What every tier answers. Defaults are those of a tier with nothing to report."""

    name: ClassVar[str]
    keeps_slots: ClassVar[bool]
    persistent: ClassVar[bool] = False
    shared: ClassVar[bool] = False
    batched_reads: ClassVar[bool] = False
    encodes_on_device: ClassVar[bool] = False  # a slot tier that can encode a page where it lives (`copy_out`: the GPU)
    capacity_bytes: int
    codec: str = "none"  # the codec (kvstore/codecs.py) the store encodes this tier's pages with
    corrupt_records = 0  # records found damaged and deleted

    @classmethod
    def from_config(cls, config: "StoreConfig") -> "Tier | None":
        """The tier the config asks for, or None where it has none."""
        raise NotImplementedError

    @property
    def fillable_bytes(self) -> int:
        """What the store's placement may fill (the tier's own overhead left out)."""
        return self.capacity_bytes

    @property
    def available(self) -> bool:
        """False while the tier cannot be reached (it then answers misses at once)."""
        return True

    def cost_bytes(self, spec: "ModelSpec", codec: "Codec", num_tokens: int) -> int:
        """Bytes a page of `num_tokens`, encoded with `codec`, takes here."""
        raise NotImplementedError

    def get(self, key: bytes) -> Any:
        raise NotImplementedError

    def delete(self, key: bytes) -> bool:
        raise NotImplementedError

    def take_failed(self) -> list[bytes]:
        """Keys whose copies the tier lost on its own (corrupt records, failed writes, evictions)."""
        return []

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued writes are done. False if `timeout_s` ran out first."""
        return True

    def stats(self) -> dict[str, int]:
        """Tier-specific counters, merged into the store's per-tier stats."""
        return {}

    def close(self) -> None:
        raise NotImplementedError


class SlotTier(Tier):
    """Preallocated memory, one flat uint8 `buffer`, carved into slots (tiers/slots.py)."""

    keeps_slots = True
    buffer: torch.Tensor  # (capacity_bytes,) uint8 on the tier's device: every slot is a range of it
    # The same memory as a numpy uint8 array where the buffer is in host memory, else None: the
    # store copies raw pages in and out of slices of it (`Slot` says why).
    buffer_array: np.ndarray | None = None

    @classmethod
    def slot_bytes(cls, nbytes: int) -> int:
        """The size of the slot a page of `nbytes` encoded bytes takes."""
        raise NotImplementedError

    def cost_bytes(self, spec: "ModelSpec", codec: "Codec", num_tokens: int) -> int:
        # Slots are sized for a full page, so tail pages and full pages share slots.
        return self.slot_bytes(codec.encoded_bytes(spec, spec.page_size))

    def allocate(self, key: bytes, nbytes: int) -> Slot:
        """A new slot of at least `nbytes` for `key`, to be written. Raises TierFull."""
        raise NotImplementedError

    def get(self, key: bytes) -> Slot | None:
        """`key`'s slot, or None. Its bytes are readable through `view` on the caller's current
        stream (a tier with copies in flight orders them before it)."""
        raise NotImplementedError

    def view(self, slot: Slot, nbytes: int) -> torch.Tensor:
        """The first `nbytes` of `slot` as a uint8 tensor (a view: writes go to the slot)."""
        offset = slot[0]
        return self.buffer[offset:offset + nbytes]

    def copy_out(self, key: bytes, spec: "ModelSpec", num_tokens: int, codec: "Codec",
                 dst: torch.Tensor) -> "torch.cuda.Event":
        """Page `key` (raw KV of `num_tokens`) encoded with `codec` where it lives, into `dst`
        (uint8, `codec.encoded_bytes(spec, num_tokens)`, in host memory): demotion from a tier
        that `encodes_on_device`, so only the encoded bytes leave the device. Returns the event
        after which `dst` holds them."""
        raise NotImplementedError


class RecordTier(Tier):
    """Self-describing records, written through a queue (`put` never copies a page twice)."""

    keeps_slots = False

    def cost_bytes(self, spec: "ModelSpec", codec: "Codec", num_tokens: int) -> int:
        return disk_record_cost(codec.encoded_bytes(spec, num_tokens), num_tokens)

    def put(self, record: PageRecord) -> WriteTicket:
        """Queue `record`; it is readable (`get`) at once. The ticket is set once it is written."""
        raise NotImplementedError

    def get(self, key: bytes) -> PageRecord | None:
        """The record, or None on a miss or a corrupt record (which the tier deletes and counts)."""
        raise NotImplementedError

    def read_ahead(self, batches: list[list[bytes]],
                   landings: Mapping[bytes, Any] | None = None) -> Iterator[dict[bytes, PageRecord | None]]:
        """The records of each batch of keys, {key: record}, in order, read as the caller asks
        for them. A `batched_reads` tier reads a batch at a time (Redis: a round trip; disk: a
        read transaction) and may land payloads in `landings` (tiers/redis_landing.py): the
        payload of a record returned with its Landing is in the landing's rows, checksum
        verified; the rows of any other key may hold garbage. This default reads one key a
        call."""
        for batch in batches:
            yield {key: self.get(key) for key in batch}

    def probe(self, keys: Iterable[bytes]) -> int:
        """How many leading `keys` the tier holds, reading no payload: a `shared` tier answers
        this (pages other sidecars stored)."""
        raise NotImplementedError

    def scan(self) -> Iterator[PageRecord]:
        """Every intact record's header (payload may be empty), for rebuilding the index."""
        raise NotImplementedError
