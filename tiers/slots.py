"""Slot bookkeeping shared by the slot tiers (cpu, gpu): which byte range of a preallocated
buffer holds which page. Pure Python; the tiers own the buffers.

Slots are handed out by size class (rounded up to the tier's alignment). A freed slot goes on
its class's free list and is reused by the next page of the same size; fresh slots are cut from
the buffer's untouched end. A store usually serves one model, so there is one class and nothing
fragments; with several page sizes, a slot freed by one serves only pages of the same size, and
`allocate` raises `TierFull` when neither a free slot nor the untouched end fits (the store then
evicts more).

Invariant: `used_bytes` is the sum of the sizes of the slots in `_slots`; no two slots overlap.
"""
from __future__ import annotations

import numpy as np
import torch

from kvstore.tiers.base import SlotTier, TierFull


class SlotMap:
    def __init__(self, tier: str, capacity_bytes: int, align_bytes: int):
        self.tier = tier
        self.capacity_bytes = capacity_bytes
        self.align_bytes = align_bytes
        self.used_bytes = 0
        self._end = 0  # bytes of the buffer cut into slots so far
        self._free: dict[int, list[int]] = {}  # slot size -> free slot offsets
        self._slots: dict[bytes, tuple[int, int]] = {}  # key -> (offset, slot size)

    def slot_bytes(self, nbytes: int) -> int:
        return -(-nbytes // self.align_bytes) * self.align_bytes

    def allocate(self, key: bytes, nbytes: int) -> int:
        """The offset of a new slot of at least `nbytes` for `key`. Raises TierFull."""
        assert key not in self._slots, "allocate of a key that already has a slot"
        size = self.slot_bytes(nbytes)
        free = self._free.get(size)
        if free:
            offset = free.pop()
        elif self._end + size <= self.capacity_bytes:
            offset = self._end
            self._end += size
        else:
            raise TierFull(f"{self.tier} tier: no free {size}-byte slot "
                           f"({self.used_bytes} of {self.capacity_bytes} bytes used)")
        self._slots[key] = (offset, size)
        self.used_bytes += size
        return offset

    def get(self, key: bytes) -> tuple[int, int] | None:
        """(offset, slot size) of `key`'s slot, or None."""
        return self._slots.get(key)

    def free(self, key: bytes) -> bool:
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

    def clear(self) -> None:
        self._slots.clear()
        self._free.clear()
        self._end = 0
        self.used_bytes = 0


class SlotBufferTier(SlotTier):
    """The part of a slot tier that is the same on every device: a preallocated uint8 `buffer`
    carved by a `SlotMap`. Subclasses set `name` and `align_bytes`, allocate `buffer`, and add
    what their device needs (the GPU tier: stream-ordered copies)."""

    align_bytes: int
    buffer: torch.Tensor
    # The buffer as a numpy array when it is in host memory (else None): the store copies raw
    # pages in and out of numpy views of it, which cost a fraction of a torch slice to make.
    buffer_array: np.ndarray | None = None

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._slots = SlotMap(self.name, capacity_bytes, self.align_bytes)

    @property
    def used_bytes(self) -> int:
        return self._slots.used_bytes

    @classmethod
    def slot_bytes(cls, nbytes: int) -> int:
        return -(-nbytes // cls.align_bytes) * cls.align_bytes

    def allocate(self, key: bytes, nbytes: int) -> torch.Tensor:
        """A writable view of `nbytes` for `key`. Raises TierFull."""
        offset = self._slots.allocate(key, nbytes)
        return self.buffer[offset:offset + nbytes]

    def get(self, key: bytes) -> torch.Tensor | None:
        slot = self._slots.get(key)
        if slot is None:
            return None
        offset, size = slot
        return self.buffer[offset:offset + size]

    def get_array(self, key: bytes) -> np.ndarray | None:
        """`get` as a numpy uint8 view, for a buffer in host memory; None elsewhere or when absent."""
        array = self.buffer_array
        slot = self._slots.get(key) if array is not None else None
        if slot is None:
            return None
        offset, size = slot
        return array[offset:offset + size]

    def allocate_array(self, key: bytes, nbytes: int) -> np.ndarray:
        """`allocate` as a numpy uint8 view of `nbytes`, for a buffer in host memory. Raises TierFull."""
        offset = self._slots.allocate(key, nbytes)
        return self.buffer_array[offset:offset + nbytes]  # type: ignore[index]

    def delete(self, key: bytes) -> bool:
        return self._slots.free(key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def close(self) -> None:
        self._slots.clear()
