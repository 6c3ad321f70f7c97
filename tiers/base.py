"""The tier interface: what the store's tier stack (kvstore/tier_stack.py) calls on every tier.

Tiers know nothing of prefixes, policies or each other: the store decides what goes where, when
to evict, demote and promote; a tier only holds bytes. There are two kinds, and the stack tells
them apart by `keeps_slots`, never by a tier's name:

- a **slot tier** (`SlotTier`: gpu, cpu) preallocates its memory and hands out slots: `allocate`
  returns a writable uint8 view that the store encodes a page straight into (one copy on the
  store path), `get` returns a read-only-by-convention view the store decodes from (one copy on
  fetch);
- a **record tier** (`RecordTier`: disk, redis) keeps self-describing records (`PageRecord`:
  header + payload + checksum), so it can rebuild the index after a restart and turn
  corruption into a miss. `put` queues a record and returns a `WriteTicket`.

What else a tier is to the store is a class attribute, not a name: `persistent` (the index is
rebuilt from it at start, close saves memory-only pages to it, write-through writes it),
`shared` (other sidecars write it: lookups probe it), `batched_reads` (it reads a batch of pages
at a time, Redis in one round trip, disk in one read transaction, and can land payloads in the
caller's buffers). Adding a tier is one module with a
subclass of `SlotTier` or `RecordTier` (and a `from_config`), and one entry in the stack's
`TIER_TYPES`.
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Iterable, Iterator, Mapping

import torch

from kvstore.tiers.disk_cost import disk_record_cost

if TYPE_CHECKING:
    from kvstore.codecs import Codec
    from kvstore.config import ModelSpec, StoreConfig

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
    encodes_on_device: ClassVar[bool] = False  # can encode a page where it lives (`copy_out`: the GPU)
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
    """Preallocated memory carved into slots (tiers/slots.py)."""

    keeps_slots = True

    @classmethod
    def slot_bytes(cls, nbytes: int) -> int:
        raise NotImplementedError

    def cost_bytes(self, spec: "ModelSpec", codec: "Codec", num_tokens: int) -> int:
        # Slots are sized for a full page, so tail pages and full pages share slots.
        return self.slot_bytes(codec.encoded_bytes(spec, spec.page_size))

    def allocate(self, key: bytes, nbytes: int) -> torch.Tensor:
        """A writable uint8 view of `nbytes` reserved for `key`. Raises TierFull."""
        raise NotImplementedError

    def get(self, key: bytes) -> torch.Tensor | None:
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
