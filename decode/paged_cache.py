"""The decode loop's paged KV cache: one preallocated buffer of pages and per-sequence block tables.

Layout is `(L, 2, num_blocks, P, H, D)`: each layer's K (and V) is one contiguous
`(num_blocks, P, H, D)` block pool, the per-layer layout vLLM uses, so attention reads a layer
without touching the others. A sequence owns a `BlockTable` (its page ids, in order); token `i`
of the sequence lives in slot `table[i // P] * P + i % P` of the flattened pool.

Pages here are the store's pages: `P` is the spec's `page_size`, so moving KV between the cache
and the store (`scatter` / `gather`, both in the store's `(L, 2, T, H, D)` layout) is page-aligned
copying. This module does not know about the store, RoPE or attention.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvstore.config import ModelSpec
from kvstore.host_copy import copy_into


@dataclass
class BlockTable:
    """The pages of one sequence, in order; `num_tokens` of their slots hold valid KV."""

    blocks: list[int] = field(default_factory=list)
    num_tokens: int = 0


class PagedKVCache:
    def __init__(self, spec: ModelSpec, num_blocks: int, *, device: str | torch.device = "cpu",
                 dtype: torch.dtype | None = None):
        assert num_blocks >= 1, num_blocks
        self.spec = spec
        self.page_size = spec.page_size
        self.num_blocks = num_blocks
        dtype = dtype or getattr(torch, spec.dtype)
        # Uninitialised on purpose: every slot is written before a sequence's table covers it.
        self.buffer = torch.empty((spec.num_layers, 2, num_blocks, spec.page_size, spec.num_kv_heads,
                                   spec.head_dim), dtype=dtype, device=device)  # (L, 2, N, P, H, D)
        self._free = list(range(num_blocks - 1, -1, -1))  # a stack: pop() hands out low ids first

    @classmethod
    def for_tokens(cls, spec: ModelSpec, num_tokens: int, **kwargs) -> "PagedKVCache":
        """A cache just big enough for one sequence of `num_tokens` tokens."""
        return cls(spec, max(1, -(-num_tokens // spec.page_size)), **kwargs)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Layer `index`'s K and V pools, flattened to slots: two (N * P, H, D) views."""
        k, v = self.buffer[index]  # (N, P, H, D) each
        return k.view(-1, *k.shape[2:]), v.view(-1, *v.shape[2:])

    # -- block tables ---------------------------------------------------------------------------

    def new_table(self) -> BlockTable:
        return BlockTable()

    def reserve(self, table: BlockTable, num_tokens: int) -> None:
        """Make `table` cover at least `num_tokens` slots, taking pages from the free list."""
        needed = -(-num_tokens // self.page_size) - len(table.blocks)
        if needed > len(self._free):
            raise MemoryError(f"paged KV cache: need {needed} more pages, {len(self._free)} free")
        for _ in range(max(0, needed)):
            table.blocks.append(self._free.pop())

    def release(self, table: BlockTable) -> None:
        self._free.extend(reversed(table.blocks))
        table.blocks.clear()
        table.num_tokens = 0

    def slots(self, table: BlockTable, start: int, end: int) -> torch.Tensor:
        """(end - start,) slot indices of sequence positions start..end-1."""
        assert 0 <= start <= end <= len(table.blocks) * self.page_size, (start, end, len(table.blocks))
        index = torch.arange(start, end, device=self.buffer.device)  # (T,)
        blocks = torch.tensor(table.blocks, dtype=torch.long, device=self.buffer.device)
        return blocks[index // self.page_size] * self.page_size + index % self.page_size

    def slot_range(self, table: BlockTable, start: int, end: int) -> slice | None:
        """The slots of positions start..end-1 as one slice when their pages are consecutive in the
        pool (the usual case: a fresh cache hands out pages in order), else None. A slice lets
        attention read keys as a view and copies run as one memcpy instead of an index copy."""
        if end <= start:
            return None
        first, last = start // self.page_size, (end - 1) // self.page_size
        assert last < len(table.blocks), (end, len(table.blocks))
        base = table.blocks[first]
        if table.blocks[first:last + 1] != list(range(base, base + last - first + 1)):
            return None
        offset = base * self.page_size - first * self.page_size
        return slice(offset + start, offset + end)

    # -- moving KV to and from the store layout -----------------------------------------------

    def scatter(self, table: BlockTable, kv: torch.Tensor, start: int = 0) -> None:
        """Write `kv` (L, 2, T, H, D) into positions start..start+T-1 of the sequence."""
        end = start + kv.shape[2]
        assert kv.shape[:2] == self.buffer.shape[:2] and kv.shape[3:] == self.buffer.shape[4:], kv.shape
        flat = self.buffer.view(*self.buffer.shape[:2], -1, *self.buffer.shape[4:])  # (L, 2, N * P, H, D)
        kv = kv.to(device=flat.device, dtype=flat.dtype)
        span = self.slot_range(table, start, end)
        if span is not None:
            # A plain copy, not torch's OpenMP one: on a busy host the pool's threads stall it.
            copy_into(flat[:, :, span], kv)
        else:
            flat.index_copy_(2, self.slots(table, start, end), kv)
        table.num_tokens = max(table.num_tokens, end)

    def gather(self, table: BlockTable, start: int, end: int) -> torch.Tensor:
        """The KV of positions start..end-1 as one contiguous (L, 2, T, H, D) tensor."""
        assert end <= table.num_tokens, (end, table.num_tokens)
        flat = self.buffer.view(*self.buffer.shape[:2], -1, *self.buffer.shape[4:])  # (L, 2, N * P, H, D)
        span = self.slot_range(table, start, end)
        if span is None:
            return flat.index_select(2, self.slots(table, start, end))  # (L, 2, T, H, D)
        out = torch.empty((*flat.shape[:2], end - start, *flat.shape[3:]), dtype=flat.dtype,
                          device=flat.device)  # (L, 2, T, H, D)
        copy_into(out, flat[:, :, span])
        return out
