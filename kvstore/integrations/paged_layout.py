"""Moving KV between one layer of an engine's paged cache and kvstore's canonical layout.

kvstore holds a request's KV as `(L, 2, T, H, D)` (docs/design.md): per layer, K then V, token
major. An engine's paged cache holds one layer as a pool of blocks of `B` tokens, and each
attention backend arranges a block its own way. A `PagedLayout` knows one arrangement and moves
whole blocks:

    gather(layer, block_ids)      -> (2, len(block_ids) * B, H, D), the blocks' tokens in order
    scatter(layer, block_ids, kv)    the inverse: writes those blocks and nothing else
    scatter_runs(layer, block_ids, runs)
                                     the same from runs of pages, `(first token, (k, 2, P, H, D))`,
                                     that lie apart (an in-process store's pages where they are:
                                     kvstore/pinned_fetch.py), joined layer by layer into a
                                     buffer instead of into a staging answer of every layer

Two arrangements cover vLLM's backends:

- `ContentSplitLayout` (FlashAttention, FlashInfer): each layer is a logical
  `(num_blocks, H, B, 2 * D)` view whose last dim is K's D values then V's. NHD and HND are the
  same logical view with different strides, so one indexing serves both: torch's strided views
  do the layout, not this code.
- vLLM's CPU backend: each block is `H * 2 * B * D` contiguous values whose order inside the
  block depends on the kernel's ISA (the K half is stored transposed, or packed for AMX). The
  order is not written down anywhere we could check, so it is measured: `probe_block_order`
  runs the backend's own cache-write op on one scratch block of coded values and reads back
  where each (K or V, token, head, dim) landed. Where K and V each land at fixed strides (the
  'vec' kernels) that is a `StridedBlockLayout`, one strided copy per half; any other
  arrangement is a `BlockPermutationLayout`, a permutation of the block's elements. Either one
  reads blocks; a `BackendWrittenLayout` writes them with the backend's own cache-write op,
  which is faster than either's strided or permuting writes.

No vLLM import here: the conversion is plain torch, so it is unit-tested on CPU tensors of every
shape, and the CPU backend's writer is passed in.
"""
from __future__ import annotations

import math
import threading
from typing import Callable

import torch

from kvstore.host_memory import empty_host


class UnsupportedLayout(ValueError):
    """The engine's paged KV layout is not one this module knows how to read; named in the message."""


class PagedLayout:
    """One layer's block arrangement. Subclasses implement `gather` and `scatter`."""

    name: str
    block_size: int
    num_kv_heads: int
    head_dim: int

    def gather(self, layer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """`out`: where to write the (2, T, H, D) answer (a fresh tensor when None)."""
        raise NotImplementedError

    def scatter(self, layer: torch.Tensor, block_ids: torch.Tensor, kv: torch.Tensor) -> None:
        raise NotImplementedError

    def scatter_runs(self, layer: torch.Tensor, block_ids: torch.Tensor, runs: list[tuple[int, torch.Tensor]]) -> None:
        """Write the blocks from `runs`, which cover their tokens [0, len(block_ids) * B) in order.
        Here by joining the runs into one (2, T, H, D) and scattering that; a layout that can
        read the runs as they lie overrides it."""
        kv = torch.empty((2, block_ids.numel() * self.block_size, self.num_kv_heads, self.head_dim),
                         dtype=layer.dtype, device=layer.device)
        join_runs(runs, kv)
        self.scatter(layer, block_ids, kv)

    def _blocks(self, layer: torch.Tensor) -> torch.Tensor:
        """A layer whose blocks are each one contiguous run of values, as (num_blocks, block_elements)."""
        if not layer.is_contiguous():
            raise UnsupportedLayout(f"{self.name}: expected a contiguous paged cache, got strides {layer.stride()}")
        return layer.view(layer.shape[0], -1)

    def _check_kv(self, kv: torch.Tensor, num_blocks: int) -> None:
        expected = (2, num_blocks * self.block_size, self.num_kv_heads, self.head_dim)
        if tuple(kv.shape) != expected:
            raise ValueError(f"kv: expected {expected} for {num_blocks} blocks, got {tuple(kv.shape)}")


class ContentSplitLayout(PagedLayout):
    """Logical `(num_blocks, H, B, 2 * D)` per layer, K in `[..., :D]` and V in `[..., D:]`,
    whatever the strides (NHD stores it as (num_blocks, B, H, 2D), HND as (num_blocks, H, B, 2D))."""

    def __init__(self, name: str, block_size: int, num_kv_heads: int, head_dim: int):
        self.name, self.block_size, self.num_kv_heads, self.head_dim = name, block_size, num_kv_heads, head_dim

    def check(self, layer: torch.Tensor) -> None:
        expected = (self.block_size, 2 * self.head_dim)
        if layer.dim() != 4 or layer.shape[1] != self.num_kv_heads or tuple(layer.shape[2:]) != expected:
            raise UnsupportedLayout(f"{self.name}: expected a (num_blocks, {self.num_kv_heads}, {self.block_size}, "
                                    f"{2 * self.head_dim}) layer, got {tuple(layer.shape)}")

    def gather(self, layer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        n, D = block_ids.numel(), self.head_dim
        blocks = layer[block_ids]  # (n, H, B, 2D), a copy in the physical order's strides
        kv = blocks.view(n, self.num_kv_heads, self.block_size, 2, D) if blocks.is_contiguous() else \
            blocks.reshape(n, self.num_kv_heads, self.block_size, 2, D)
        # (n, H, B, 2, D) -> (2, n, B, H, D) -> (2, n * B, H, D)
        return _into(out, kv.permute(3, 0, 2, 1, 4).reshape(2, n * self.block_size, self.num_kv_heads, D))

    def scatter(self, layer: torch.Tensor, block_ids: torch.Tensor, kv: torch.Tensor) -> None:
        n = block_ids.numel()
        self._check_kv(kv, n)
        # (2, n * B, H, D) -> (n, H, B, 2, D)
        blocks = kv.view(2, n, self.block_size, self.num_kv_heads, self.head_dim).permute(1, 3, 2, 0, 4)
        layer[block_ids] = blocks.reshape(n, self.num_kv_heads, self.block_size, 2 * self.head_dim).to(layer.dtype)


class BlockPermutationLayout(PagedLayout):
    """Each block is `block_elements` contiguous values; `order[c]` is where the value with
    canonical index `c` (in `(2, B, H, D)` order) sits inside the block."""

    def __init__(self, name: str, block_size: int, num_kv_heads: int, head_dim: int, order: torch.Tensor):
        self.name, self.block_size, self.num_kv_heads, self.head_dim = name, block_size, num_kv_heads, head_dim
        expected = 2 * block_size * num_kv_heads * head_dim
        if order.shape != (expected,):
            raise ValueError(f"order: expected {expected} positions, got {tuple(order.shape)}")
        self.order = order.to(torch.long)
        self.inverse = torch.argsort(self.order)  # inverse[p]: the canonical index held at block position p

    # Whole rows first (index_select on blocks), then the permutation inside each row: two
    # contiguous gathers, several times faster than one 2-D advanced index over the same values.
    def gather(self, layer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        n = block_ids.numel()
        rows = self._blocks(layer).index_select(0, block_ids)  # (n, block_elements), the block's order
        kv = rows.index_select(1, self.order.to(rows.device)).view(n, 2, self.block_size, self.num_kv_heads,
                                                                   self.head_dim)
        return _into(out, kv.transpose(0, 1).reshape(2, n * self.block_size, self.num_kv_heads, self.head_dim))

    def scatter(self, layer: torch.Tensor, block_ids: torch.Tensor, kv: torch.Tensor) -> None:
        n = block_ids.numel()
        self._check_kv(kv, n)
        blocks = self._blocks(layer)
        canonical = kv.view(2, n, self.block_size, self.num_kv_heads, self.head_dim).transpose(0, 1).reshape(n, -1)
        rows = canonical.to(blocks.dtype).index_select(1, self.inverse.to(blocks.device))  # (n, block_elements)
        blocks.index_copy_(0, block_ids, rows)


class StridedBlockLayout(PagedLayout):
    """A block arrangement where K and V each sit at an offset inside the block with a stride per
    (token, head, dim): a strided view of the pool per half, so a gather or scatter is one
    strided copy instead of a permutation. vLLM's CPU 'vec' kernels (K stored (D, B) per head,
    V (B, D)) are of this kind. `from_order` finds the strides or answers None."""

    def __init__(self, name: str, block_size: int, num_kv_heads: int, head_dim: int,
                 halves: tuple[tuple[int, tuple[int, int, int]], ...]):
        self.name, self.block_size, self.num_kv_heads, self.head_dim = name, block_size, num_kv_heads, head_dim
        self.halves = halves  # per K, V: (offset in the block, (token, head, dim) strides)
        self._rows = threading.local()

    @classmethod
    def from_order(cls, name: str, block_size: int, num_kv_heads: int, head_dim: int,
                   order: torch.Tensor) -> "StridedBlockLayout | None":
        B, H, D = block_size, num_kv_heads, head_dim
        grid = order.view(2, B, H, D)
        t, h, d = torch.meshgrid(torch.arange(B), torch.arange(H), torch.arange(D), indexing="ij")
        halves: list[tuple[int, tuple[int, int, int]]] = []
        for kv in range(2):
            offset = int(grid[kv, 0, 0, 0])
            token, head, dim = (int(grid[(kv,) + step] - offset) if size > 1 else 0
                                for step, size in (((1, 0, 0), B), ((0, 1, 0), H), ((0, 0, 1), D)))
            if not torch.equal(grid[kv], offset + t * token + h * head + d * dim):
                return None
            halves.append((offset, (token, head, dim)))
        return cls(name, B, H, D, tuple(halves))

    def _halves_of(self, blocks: torch.Tensor) -> list[torch.Tensor]:
        """K and V of `blocks`, a (num_blocks, block_elements) tensor: (num_blocks, B, H, D) views."""
        return [blocks.as_strided((blocks.shape[0], self.block_size, self.num_kv_heads, self.head_dim),
                                  (blocks.shape[1], *strides), blocks.storage_offset() + offset)
                for offset, strides in self.halves]

    # On the CPU whole blocks are copied out as rows (into this thread's reused buffer), then K
    # and V rearranged from the rows by one strided copy each: two copies of the kind a CPU does
    # fast, where one strided index_select out of the pool measured slower.
    def gather(self, layer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        n, B, H, D = block_ids.numel(), self.block_size, self.num_kv_heads, self.head_dim
        if out is None:
            out = torch.empty((2, n * B, H, D), dtype=layer.dtype, device=layer.device)
        self._check_kv(out, n)
        blocks = self._blocks(layer)
        if layer.is_cpu:
            rows = _scratch(self._rows, n * blocks.shape[1], layer.dtype).view(n, -1)
            torch.index_select(blocks, 0, block_ids, out=rows)
            for half, view in enumerate(self._halves_of(rows)):
                out[half].view(n, B, H, D).copy_(view)
        else:
            for half, view in enumerate(self._halves_of(blocks)):
                out[half].view(n, B, H, D).copy_(torch.index_select(view, 0, block_ids))
        return out

    def scatter(self, layer: torch.Tensor, block_ids: torch.Tensor, kv: torch.Tensor) -> None:
        n = block_ids.numel()
        self._check_kv(kv, n)
        kv = kv.to(layer.dtype).view(2, n, self.block_size, self.num_kv_heads, self.head_dim)
        for half, view in enumerate(self._halves_of(self._blocks(layer))):
            view.index_copy_(0, block_ids, kv[half])


class BackendWrittenLayout(PagedLayout):
    """A layout whose blocks are written by the backend's own cache-write op, the one its forward
    writes new K/V with (vLLM's CPU backend: `cpu_attn_reshape_and_cache`), and read by `reader`.

    On the CPU backend this is the scatter that costs least: a run of pages is joined into one
    (2, T, H, D) layer (contiguous reads of each page's layer, into a reused buffer that stays
    in cache), and the writer puts the tokens at their slots in whatever arrangement its ISA
    keeps (K transposed, or packed for AMX) with the vectorised, threaded loop the forward uses.
    Rearranging with torch's strided copies measured slower (docs/design.md §7.4)."""

    def __init__(self, reader: PagedLayout, write: SlotWriter):
        self.reader, self.write = reader, write
        self.name = f"{reader.name}+writer"
        self.block_size, self.num_kv_heads, self.head_dim = reader.block_size, reader.num_kv_heads, reader.head_dim
        self._joined = threading.local()
        self._slots: tuple[torch.Tensor, torch.Tensor] | None = None  # (block_ids, their slots), the last used

    def gather(self, layer: torch.Tensor, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        return self.reader.gather(layer, block_ids, out)

    def scatter(self, layer: torch.Tensor, block_ids: torch.Tensor, kv: torch.Tensor) -> None:
        self._check_kv(kv, block_ids.numel())
        kv = kv.to(layer.dtype)
        self.write(layer, kv[0], kv[1], self._slots_of(block_ids, layer.shape[0]))

    def scatter_runs(self, layer: torch.Tensor, block_ids: torch.Tensor, runs: list[tuple[int, torch.Tensor]]) -> None:
        n, H, D = block_ids.numel(), self.num_kv_heads, self.head_dim
        joined = _scratch(self._joined, 2 * n * self.block_size * H * D, layer.dtype).view(2, -1, H, D)
        slots = self._slots_of(block_ids, layer.shape[0])
        join_runs(runs, joined)
        self.write(layer, joined[0], joined[1], slots)

    def _slots_of(self, block_ids: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """Each token's slot (block id x B + offset in the block), as the writer takes them. A
        load's layers share one `block_ids` tensor, so its slots are made (and its ids checked:
        the backend's op writes where the slots say, unchecked) once per load."""
        cached = self._slots
        if cached is not None and cached[0] is block_ids:
            return cached[1]
        if block_ids.numel() and not (0 <= int(block_ids.min()) and int(block_ids.max()) < num_blocks):
            raise ValueError(f"block_ids: expected ids in [0, {num_blocks}), got {block_ids.min()}..{block_ids.max()}")
        offsets = torch.arange(self.block_size, dtype=torch.long, device=block_ids.device)
        slots = (block_ids.to(torch.long)[:, None] * self.block_size + offsets).reshape(-1)
        self._slots = (block_ids, slots)
        return slots


def join_runs(runs: list[tuple[int, torch.Tensor]], joined: torch.Tensor) -> None:
    """Copy the tokens [0, T) of `runs` (`(first token, (k, 2, P, H, D) pages)`, in order, with
    no gap) into `joined` (2, T, H, D); pages past T are read only as far as T."""
    end, H, D = joined.shape[1], joined.shape[2], joined.shape[3]
    covered = 0  # runs cover tokens [0, covered) so far
    for first, pages in runs:
        k, P = pages.shape[0], pages.shape[2]
        if first != covered or tuple(pages.shape[3:]) != (H, D) or pages.shape[1] != 2:
            raise ValueError(f"runs: expected (k, 2, P, {H}, {D}) pages covering tokens [0, {end}) in order, "
                             f"got a run at token {first} of {tuple(pages.shape)}")
        covered = first + k * P
        used = min(k, -(-(end - first) // P)) if first < end else 0  # pages that reach into [0, end)
        whole = min(used, (end - first) // P)  # ... of them, those wholly inside
        if whole:
            joined[:, first:first + whole * P].view(2, whole, P, H, D).copy_(pages[:whole].transpose(0, 1))
        if used > whole:  # a page that runs past the end: its first tokens only
            t = first + whole * P
            joined[:, t:end].copy_(pages[whole, :, :end - t])
    if covered < end:
        raise ValueError(f"runs: cover tokens [0, {covered}), expected [0, {end})")


def _scratch(local: threading.local, elements: int, dtype: torch.dtype) -> torch.Tensor:
    """This thread's reused buffer of at least `elements` values, grown to the largest asked
    for: reused, it costs no page faults (a fresh one of a long prompt's layer faults in every
    page, every layer). Per thread: an asynchronous load's thread copies beside the forward's."""
    buffer = getattr(local, "buffer", None)
    if buffer is None or buffer.dtype != dtype or buffer.numel() < elements:
        buffer = local.buffer = empty_host((elements,), dtype)
    return buffer[:elements]


def _into(out: torch.Tensor | None, kv: torch.Tensor) -> torch.Tensor:
    """`kv`, written into `out` when there is one."""
    if out is None:
        return kv
    if out.shape != kv.shape:
        raise ValueError(f"out: expected {tuple(kv.shape)}, got {tuple(out.shape)}")
    return out.copy_(kv)


# A cache writer as vLLM's CPU backend has one: (layer (num_blocks, H, B, 2D), key (T, H, D),
# value (T, H, D), slot_mapping (T,)) writes those tokens into the layer's blocks at those slots,
# in the backend's own arrangement. key and value may be strided views; slot_mapping must be
# contiguous (vLLM's op reads it as a flat array, whatever its strides say).
SlotWriter = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], None]


def probe_block_order(write: SlotWriter, *, block_size: int, num_kv_heads: int, head_dim: int,
                      dtype: torch.dtype, name: str) -> torch.Tensor:
    """Where each canonical `(2, B, H, D)` element of a block lands when `write` stores it.

    Every canonical index c is written as base-`radix` digits, one pass per digit, each digit
    stored as digit + 1 (small integers are exact in bf16, fp16 and fp32; 0 marks a value the
    writer did not touch). Refuses, naming `name`, a writer that drops, duplicates or invents
    values: then the arrangement is not a permutation and no index can undo it."""
    B, H, D = block_size, num_kv_heads, head_dim
    total = 2 * B * H * D
    radix = 128
    passes = max(1, math.ceil(math.log(total, radix)))
    canonical = torch.arange(total, dtype=torch.long).view(2, B, H, D)  # (2, B, H, D)
    slots = torch.arange(B, dtype=torch.long)
    position_code = None  # per block element: the canonical index it holds
    for p in range(passes):
        digits = (canonical // radix ** p) % radix + 1  # (2, B, H, D) in [1, radix]
        block = torch.zeros((1, H, B, 2 * D), dtype=dtype)
        write(block, digits[0].to(dtype), digits[1].to(dtype), slots)
        got = block.reshape(-1).to(torch.float64).round().to(torch.long)  # (H * B * 2D,)
        if bool(((got < 0) | (got > radix)).any()):
            raise UnsupportedLayout(f"{name}: the cache writer changed the values it stored; cannot map its layout")
        part = (got - 1) * radix ** p
        position_code = part if position_code is None else position_code + part
        if p == 0:
            untouched = got == 0
    assert position_code is not None
    if bool(untouched.any()) or position_code.numel() != total:
        raise UnsupportedLayout(f"{name}: the cache writer left {int(untouched.sum())} values of a block unwritten; "
                                f"its layout is not a permutation of (2, B, H, D)")
    order = torch.full((total,), -1, dtype=torch.long)
    order[position_code] = torch.arange(total, dtype=torch.long)
    if bool((order < 0).any()) or not torch.equal(torch.sort(position_code).values, torch.arange(total)):
        raise UnsupportedLayout(f"{name}: the cache writer put two values in one place; cannot map its layout")
    return order
