"""CPU tier: one preallocated host buffer carved into page slots.

No allocation per page: the slab is allocated once (pinned when CUDA is available, so
host<->device copies are asynchronous DMA) and carved into slots by `tiers.slots.SlotMap` (size
classes, free lists; `TierFull` when no slot fits, and the store evicts more). The tier keeps
bytes; it knows nothing of pages' meaning.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvstore.host_memory import empty_host
from kvstore.tiers.slots import SlotBufferTier

if TYPE_CHECKING:
    from kvstore.config import StoreConfig

SLOT_ALIGN_BYTES = 64  # cache-line aligned slots: copies in and out run at full speed


def _pin_memory_available() -> bool:
    try:
        return torch.cuda.is_available()
    except Exception:  # pragma: no cover - a broken CUDA install must not break the CPU tier
        return False


class CPUTier(SlotBufferTier):
    name = "cpu"
    align_bytes = SLOT_ALIGN_BYTES

    def __init__(self, capacity_bytes: int, *, pin_memory: bool | None = None, codec: str = "none"):
        if capacity_bytes <= 0:
            raise ValueError(f"cpu_bytes: must be > 0 for a CPU tier, got {capacity_bytes}")
        pin = _pin_memory_available() if pin_memory is None else pin_memory
        # Pinned when CUDA is there (DMA copies); otherwise in transparent huge pages: one fault
        # and one TLB entry per 2 MiB instead of per 4 KiB.
        self.buffer = torch.empty(capacity_bytes, dtype=torch.uint8, pin_memory=True) if pin \
            else empty_host((capacity_bytes,), torch.uint8)
        # Touch every page now (one memset, single-threaded): a first write into fresh memory
        # page-faults, which slowed every store until the tier had filled once. The tier's
        # memory is resident from the start, as its capacity promises.
        self.buffer_array = self.buffer.numpy()
        self.buffer_array.fill(0)
        self.codec = codec
        super().__init__(capacity_bytes)

    @classmethod
    def from_config(cls, config: "StoreConfig") -> "CPUTier | None":
        return cls(config.cpu_bytes, codec=config.cpu_codec) if config.cpu_bytes else None
