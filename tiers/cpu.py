"""CPU tier: one preallocated host buffer carved into page slots.

No allocation per page: the slab is allocated once (pinned when CUDA is available, so
host<->device copies are asynchronous DMA), and slots are handed out by size class. A slot
freed by `delete` goes on its size class's free list and is reused by the next page of the same
size; fresh slots are cut from the untouched end of the slab.

A store usually serves one model, so there is one size class and the slab never fragments. With
several models of different page sizes, a slot freed by one model serves only models of the same
page size; `allocate` raises `TierFull` when no slot of the size is free and the slab's end is
used up, and the store evicts more. The tier keeps bytes; it knows nothing of pages' meaning.
"""
from __future__ import annotations

import torch

from kvstore.host_memory import empty_host
from tiers.base import TierFull

SLOT_ALIGN_BYTES = 64  # cache-line aligned slots: copies in and out run at full speed


def _pin_memory_available() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - a broken CUDA install must not break the CPU tier
        return False


class CPUTier:
    name = "cpu"

    def __init__(self, capacity_bytes: int, *, pin_memory: bool | None = None):
        if capacity_bytes <= 0:
            raise ValueError(f"cpu_bytes: must be > 0 for a CPU tier, got {capacity_bytes}")
        pin = _pin_memory_available() if pin_memory is None else pin_memory
        self.capacity_bytes = capacity_bytes
        # Pinned when CUDA is there (DMA copies); otherwise in transparent huge pages, which fault
        # in and translate 512x cheaper than 4 KiB pages.
        self.slab = torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=True) if pin \
            else empty_host((capacity_bytes,), torch.uint8)
        # Touch every page now (one memset, single-threaded): a first write into fresh memory
        # page-faults, which made a 2 MiB store ~10x slower until the tier had filled once.
        # The tier's memory is resident from the start, as its capacity promises.
        self.slab.numpy().fill(0)
        self._end = 0  # bytes of the slab cut into slots so far
        self._free: dict[int, list[int]] = {}  # slot size -> free slot offsets
        self._slots: dict[bytes, tuple[int, int]] = {}  # key -> (offset, slot size)
        self.used_bytes = 0

    @staticmethod
    def slot_bytes(nbytes: int) -> int:
        return -(-nbytes // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES

    def allocate(self, key: bytes, nbytes: int) -> torch.Tensor:
        assert key not in self._slots, "allocate of a key that already has a slot"
        size = self.slot_bytes(nbytes)
        free = self._free.get(size)
        if free:
            offset = free.pop()
        elif self._end + size <= self.capacity_bytes:
            offset = self._end
            self._end += size
        else:
            raise TierFull(f"cpu tier: no free {size}-byte slot ({self.used_bytes} of {self.capacity_bytes} bytes used)")
        self._slots[key] = (offset, size)
        self.used_bytes += size
        return self.slab[offset:offset + nbytes]

    def get(self, key: bytes) -> torch.Tensor | None:
        slot = self._slots.get(key)
        if slot is None:
            return None
        offset, size = slot
        return self.slab[offset:offset + size]

    def delete(self, key: bytes) -> bool:
        slot = self._slots.pop(key, None)
        if slot is None:
            return False
        offset, size = slot
        self._free.setdefault(size, []).append(offset)
        self.used_bytes -= size
        return True

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def close(self) -> None:
        self._slots.clear()
        self._free.clear()
