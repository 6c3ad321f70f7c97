"""CPU tier: one preallocated host buffer carved into page slots.

No allocation per page: the slab is allocated once (pinned when CUDA is available, so
host<->device copies are asynchronous DMA) and carved into slots by `tiers.slots.SlotMap` (size
classes, free lists; `TierFull` when no slot fits, and the store evicts more). The tier keeps
bytes; it knows nothing of pages' meaning.
"""
from __future__ import annotations

import torch

from kvstore.host_memory import empty_host
from tiers.slots import SlotMap

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
        self._slots = SlotMap("cpu", capacity_bytes, SLOT_ALIGN_BYTES)

    @property
    def used_bytes(self) -> int:
        return self._slots.used_bytes

    @staticmethod
    def slot_bytes(nbytes: int) -> int:
        return -(-nbytes // SLOT_ALIGN_BYTES) * SLOT_ALIGN_BYTES

    def allocate(self, key: bytes, nbytes: int) -> torch.Tensor:
        offset = self._slots.allocate(key, nbytes)
        return self.slab[offset:offset + nbytes]

    def get(self, key: bytes) -> torch.Tensor | None:
        slot = self._slots.get(key)
        if slot is None:
            return None
        offset, size = slot
        return self.slab[offset:offset + size]

    def delete(self, key: bytes) -> bool:
        return self._slots.free(key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def close(self) -> None:
        self._slots.clear()
