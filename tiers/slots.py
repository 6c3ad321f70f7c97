"""Slot bookkeeping shared by the slot tiers (cpu, gpu): which byte range of a preallocated
buffer holds which page. Pure Python; the tiers own the buffers.

Slots are cut by size (rounded up to the tier's alignment) from free ranges, or from the
buffer's untouched end. A store usually serves one model, so most pages have one size and a
freed slot is taken whole by the next page (`_by_size`: one set lookup). Free ranges merge with
free neighbours as they are freed, and a range that reaches the untouched end goes back to it,
so pages of another size (a second model) find room once enough neighbouring pages are gone;
without a range of the exact size, the smallest larger one is split. `allocate` raises
`TierFull` when no range fits (the store then evicts more).

Invariants: `used_bytes` is the sum of the sizes of the slots in `_slots`; slots and free ranges
never overlap and together tile [0, `_end`); no two free ranges touch, and none ends at `_end`;
`_free_at`, `_free_end` and `_by_size` describe the same free ranges.
"""
from __future__ import annotations

from kvstore.tiers.base import Slot, SlotTier, TierFull


class SlotMap:
    def __init__(self, tier: str, capacity_bytes: int, align_bytes: int):
        self.tier = tier
        self.capacity_bytes = capacity_bytes
        self.align_bytes = align_bytes
        self.used_bytes = 0
        self._end = 0  # bytes of the buffer cut into slots so far
        self._free_at: dict[int, int] = {}  # free range offset -> size
        self._free_end: dict[int, int] = {}  # free range end -> offset
        self._by_size: dict[int, set[int]] = {}  # free range size -> offsets (no empty sets)
        self._slots: dict[bytes, Slot] = {}  # key -> (offset, slot size)

    def slot_bytes(self, nbytes: int) -> int:
        return -(-nbytes // self.align_bytes) * self.align_bytes

    def allocate(self, key: bytes, nbytes: int) -> Slot:
        """A new slot of at least `nbytes` for `key`: (offset, slot size). Raises TierFull."""
        assert key not in self._slots, "allocate of a key that already has a slot"
        size = self.slot_bytes(nbytes)
        if size in self._by_size:
            offset = self._take_free(size)
        elif self._end + size <= self.capacity_bytes:
            offset = self._end
            self._end += size
        else:
            larger = [free_size for free_size in self._by_size if free_size > size]
            if not larger:
                raise TierFull(f"{self.tier} tier: no free {size}-byte slot "
                               f"({self.used_bytes} of {self.capacity_bytes} bytes used)")
            free_size = min(larger)  # the smallest range that fits: keep large ranges whole
            offset = self._take_free(free_size)
            self._add_free(offset + size, free_size - size)
        slot = self._slots[key] = (offset, size)
        self.used_bytes += size
        return slot

    def get(self, key: bytes) -> Slot | None:
        """(offset, slot size) of `key`'s slot, or None."""
        return self._slots.get(key)

    def free(self, key: bytes) -> bool:
        slot = self._slots.pop(key, None)
        if slot is None:
            return False
        offset, size = slot
        self.used_bytes -= size
        left = self._free_end.get(offset)
        if left is not None:  # merge with the free range just before
            self._remove_free(left, offset - left)
            offset, size = left, size + offset - left
        right = self._free_at.get(offset + size)
        if right is not None:  # ... and the one just after
            self._remove_free(offset + size, right)
            size += right
        if offset + size == self._end:
            self._end = offset  # back to the untouched end
        else:
            self._add_free(offset, size)
        return True

    def _add_free(self, offset: int, size: int) -> None:
        self._free_at[offset] = size
        self._free_end[offset + size] = offset
        self._by_size.setdefault(size, set()).add(offset)

    def _remove_free(self, offset: int, size: int) -> None:
        del self._free_at[offset]
        del self._free_end[offset + size]
        offsets = self._by_size[size]
        offsets.discard(offset)
        if not offsets:
            del self._by_size[size]

    def _take_free(self, size: int) -> int:
        offsets = self._by_size[size]
        offset = offsets.pop()
        if not offsets:
            del self._by_size[size]
        del self._free_at[offset]
        del self._free_end[offset + size]
        return offset

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def clear(self) -> None:
        self._slots.clear()
        self._free_at.clear()
        self._free_end.clear()
        self._by_size.clear()
        self._end = 0
        self.used_bytes = 0


class SlotBufferTier(SlotTier):
    """The part of a slot tier that is the same on every device: a preallocated uint8 `buffer`
    carved by a `SlotMap`. Subclasses set `name` and `align_bytes`, allocate `buffer` (and
    `buffer_array`, in host memory), and add what their device needs (the GPU tier:
    stream-ordered copies)."""

    align_bytes: int

    def __init__(self, capacity_bytes: int):
        self.capacity_bytes = capacity_bytes
        self._slots = SlotMap(self.name, capacity_bytes, self.align_bytes)

    @property
    def used_bytes(self) -> int:
        return self._slots.used_bytes

    @classmethod
    def slot_bytes(cls, nbytes: int) -> int:
        return -(-nbytes // cls.align_bytes) * cls.align_bytes

    def allocate(self, key: bytes, nbytes: int) -> Slot:
        return self._slots.allocate(key, nbytes)

    def get(self, key: bytes) -> Slot | None:
        return self._slots.get(key)

    def delete(self, key: bytes) -> bool:
        return self._slots.free(key)

    def __contains__(self, key: bytes) -> bool:
        return key in self._slots

    def __len__(self) -> int:
        return len(self._slots)

    def close(self) -> None:
        self._slots.clear()
