"""The two tier protocols. Tiers know nothing of prefixes, policies or each other: the store
decides what goes where, when to evict, demote and promote; a tier only holds bytes.

- A **slot tier** (gpu, cpu) preallocates its memory and hands out slots: `allocate` returns a
  writable uint8 view that the store encodes a page straight into (one copy on the store path),
  `get` returns a read-only-by-convention view the store decodes from (one copy on fetch).
- A **record tier** (disk, redis) keeps self-describing records (`PageRecord`: header + payload
  + checksum), so it can rebuild the index after a restart and turn corruption into a miss.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterator, Protocol

import torch


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


class SlotTier(Protocol):
    name: str
    capacity_bytes: int
    used_bytes: int

    def allocate(self, key: bytes, nbytes: int) -> torch.Tensor:
        """A writable uint8 view of `nbytes` reserved for `key`. Raises TierFull."""

    def get(self, key: bytes) -> torch.Tensor | None: ...

    def delete(self, key: bytes) -> bool: ...

    def __contains__(self, key: bytes) -> bool: ...

    def __len__(self) -> int: ...

    def close(self) -> None: ...


class RecordTier(Protocol):
    name: str
    capacity_bytes: int

    def put(self, record: PageRecord) -> None: ...

    def get(self, key: bytes) -> PageRecord | None:
        """The record, or None on a miss or a corrupt record (which the tier deletes and counts)."""

    def delete(self, key: bytes) -> bool: ...

    def scan(self) -> Iterator[PageRecord]:
        """Every intact record's header (payload may be empty), for rebuilding the index."""

    def __contains__(self, key: bytes) -> bool: ...

    def __len__(self) -> int: ...

    def close(self) -> None: ...
