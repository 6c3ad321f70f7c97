"""A fetch, planned once: match and pin under the store's lock, then read the pages outside it.

    plan_fetch (under the lock)  match the prompt, count, touch and pin every matched page, and
                                 note where each page is read from: its slot (memory) or a record
                                 (disk, Redis: I/O). The plan says whether it `needs_io`.
    FetchPlan.run (any thread)   decode the pages into one answer tensor, then (under the lock)
                                 promote lower-tier hits to the top tier and unpin.

A caller that must not wait on I/O (the sidecar's event loop) runs a plan that does not need
it itself, and hands one that does to a thread: the prompt is matched once either way.

Invariants: every page of `path` is pinned from `plan_fetch` until `run` or `release`, which
unpin each exactly once (a plan is run or released once); a page's bytes are read only while
it is pinned; a page whose copy turns out lost ends the answer there (`matched_tokens` shrinks),
it never yields wrong KV. Whichever of `run` and `release` comes first claims the plan (an
atomic one-shot), so a plan given up while a thread starts running it is unpinned once.
"""
from __future__ import annotations

from typing import Literal

import numpy as np
import torch

from kvstore.config import ModelSpec
from kvstore.copy_threads import Copy, copy_all
from kvstore.gpu.dtypes import KV_DTYPES, NUMPY_DTYPES
from kvstore.host_copy import copy_into
from kvstore.host_memory import empty_host_bytes
from kvstore.index import TOKEN_BYTES, Node
from kvstore.page_moves import promote as promote_page
from kvstore.page_slice import WHOLE, PageSlice
from kvstore.results import FetchResult
from kvstore.store_state import StoreState, empty_kv
from kvstore.tiers.base import PageRecord, Slot
from kvstore.tiers.redis_landing import Landing
from kvstore.validation import on_cpu

# (page, first token, tokens used, tier, slot). The slot: where the page lies in its slot tier
# (raw pages in host memory, `TierStack.raw_buffers`, are copied from there with numpy; any other
# is decoded by its tier's codec), or None: a record, read from its record tier (I/O).
Read = tuple[Node, int, int, str, Slot | None]


class FetchPlan:
    """The pages one fetch reads, pinned. `run` it once, or `release` it."""

    __slots__ = ("state", "spec", "start", "dev", "into", "count", "path", "reads", "matched_tokens",
                 "needs_io", "nbytes", "part", "_unclaimed")

    def __init__(self, state: StoreState, spec: ModelSpec, start: int, dev: torch.device, into: torch.Tensor | None,
                 count: bool, path: list[Node], reads: list[Read], matched_tokens: int, needs_io: bool,
                 part: PageSlice = WHOLE):
        self.state = state
        self.spec = spec
        self.part = part  # the layers and KV heads the answer holds (a tensor-parallel rank's)
        self.start = start
        self.dev = dev
        self.into = into  # where the answer goes when it fits (a client's shared memory)
        self.count = count
        self.path = path  # pinned: every matched page, from the first one on
        self.reads = reads  # the pages the answer is read from (those past `start`)
        self.matched_tokens = matched_tokens
        self.needs_io = needs_io  # a page is read from a record tier (disk, Redis): running the plan waits on I/O
        self.nbytes = max(0, matched_tokens - start) * part.bytes_per_token(spec)  # the answer's size
        # One token, taken by whichever of run and release comes first: list.pop is atomic, and
        # a lock per plan costs more than the rest of a small fetch's bookkeeping.
        self._unclaimed = [True]

    @property
    def claimed(self) -> bool:
        return not self._unclaimed

    def run(self) -> FetchResult:
        """Read the pages into the answer: KV of tokens [start, matched_tokens) (fewer when a
        copy turned out lost). Unpins the pages, also when reading fails."""
        if not self._claim():
            raise RuntimeError("fetch plan: already run or released (a plan runs once)")
        start, matched = self.start, self.matched_tokens
        if matched <= start:
            return FetchResult(matched, empty_kv(self.spec, self.dev, self.part))
        out, out_array, out_rows, raw_buffers = self._buffer()
        promote: list[tuple[Node, torch.Tensor | np.ndarray]] = []
        lost: list[tuple[Node, str]] = []  # record copies that could not be read
        # The raw pages' copies, made together once every page is planned (copy_threads.py
        # splits a large answer between threads); the pages stay pinned until they are done.
        uncopied: list[Copy] = []
        try:
            matched = self._read(out, out_array, out_rows, raw_buffers, promote, lost, uncopied)
            copy_all(uncopied)
            uncopied.clear()
        finally:
            # A fetch that failed before its copies ran has no answer to promote from.
            self._finish(promote if not uncopied else [], lost, matched)
        if matched <= start:
            return FetchResult(matched, empty_kv(self.spec, self.dev, self.part))
        return FetchResult(matched, out if matched == self.matched_tokens else out[:, :, :matched - start])

    def _buffer(self) -> tuple[torch.Tensor, np.ndarray | None, np.ndarray | None, dict[str, np.ndarray]]:
        """buffer: the answer, (L, 2, T, H, D) -> (it as a tensor, as a numpy array, as rows, the
        tiers whose pages are copied into the rows as bytes). On the host the array and the
        tensor share memory (the caller's `into` when it fits): pages a codec decodes go into
        the tensor, raw pages as bytes into the rows (a numpy view costs a fraction of a torch
        one): the answer as (L * 2) rows of T tokens' bytes, where a page's slot, (L * 2) rows of
        its n tokens' bytes, is one column range (`copy_raw_pages`). Into a GPU answer no page
        is copied as bytes."""
        spec, part = self.spec, self.part
        shape, dtype = part.kv_shape(spec, self.matched_tokens - self.start), KV_DTYPES[spec.dtype]
        if not on_cpu(self.dev):
            return torch.empty(shape, dtype=dtype, device=self.dev), None, None, {}
        into, nbytes = self.into, self.nbytes
        flat = into.numpy()[:nbytes] if into is not None and into.numel() >= nbytes else empty_host_bytes(nbytes)
        out_array = flat.view(NUMPY_DTYPES[spec.dtype]).reshape(shape)
        out = torch.from_numpy(out_array)
        if out.dtype != dtype:
            out = out.view(dtype)  # bfloat16, which numpy holds as its bits
        return out, out_array, flat.reshape(shape[0] * 2, nbytes // (shape[0] * 2)), self.state.tiers.raw_buffers

    def _read(self, out: torch.Tensor, out_array: np.ndarray | None, out_rows: np.ndarray | None,
              raw_buffers: dict[str, np.ndarray], promote: list[tuple[Node, torch.Tensor | np.ndarray]],
              lost: list[tuple[Node, str]], uncopied: list[Copy]) -> int:
        """read (any thread; the pages are pinned): every page into the answer, a raw page's copy
        queued on `uncopied`, a lower tier's hit on `promote`, a copy found lost on `lost` (the
        answer ends before it) -> the tokens matched."""
        state, spec, start, part, reads = self.state, self.spec, self.start, self.part, self.reads
        tiers = state.tiers
        top, promote_on_hit = tiers.top, state.config.promote_on_hit
        records: dict[bytes, PageRecord | None] = {}
        stream = None
        copied = 0  # the reads before this one are in the answer's copies already
        for i, (node, first, used, tier, slot) in enumerate(reads):
            lo = first if first >= start else start  # tokens [lo, first + used) of the prompt come from this page
            a, b = lo - start, first + used - start  # ... and go to [a, b) of the answer
            page: torch.Tensor | Literal[True] | None  # True: its tokens are in the answer already
            if tier in raw_buffers:  # a raw page in host memory (so `out_rows` is the answer's)
                if i >= copied:
                    assert out_rows is not None
                    copied = copy_raw_pages(reads, i, start, raw_buffers, out_rows,
                                            part.bytes_per_token(spec) // out_rows.shape[0], uncopied) \
                        if part.whole else copy_raw_slices(reads, i, start, raw_buffers, out_rows, spec, part, uncopied)
                page = True
            else:
                record = None
                if slot is None:
                    if node.key not in records:
                        if stream is None:  # payloads land in the answer where they can
                            stream = tiers.record_batches(reads, spec, None if not part.whole else
                                                          out if out_array is None else out_array, start)
                        records = next(stream, {})
                    record = records.pop(node.key, None)
                if record is not None and record.payload.__class__ is Landing:
                    page = True  # landed in the answer, its header checked against this page (record_batches)
                else:  # a slice is taken from the page decoded whole (a codec decodes whole pages)
                    whole = lo == first and used == node.num_tokens and part.whole
                    page = tiers.read_page(spec, node, tier, slot, record, whole=whole, out=out[:, :, a:b])
                if page is None:  # the copy went bad (corrupt, evicted, unreachable): serve what came before it
                    lost.append((node, tier))
                    return first
                if page is not True:
                    copy_into(out[:, :, a:b], part.take(page)[:, :, lo - first:used])
            if tier != top and promote_on_hit and lo == first and (part.whole or page is not True):
                promote.append((node, self._promoted_kv(node, used, tier, slot, page, out, out_array, a, b)))
        return self.matched_tokens

    def _promoted_kv(self, node: Node, used: int, tier: str, slot: Slot | None, page: torch.Tensor | Literal[True],
                     out: torch.Tensor, out_array: np.ndarray | None, a: int, b: int) -> torch.Tensor | np.ndarray:
        """What a promoted page is copied from: decoded whole on its own; or, read whole from a
        raw host slot, that slot, pinned and contiguous, so a device top tier takes it in one DMA
        (the answer's rows are pageable and strided: docs/performance.md "GPU kernels"); else its
        tokens in the answer, whose numpy view a raw host top tier takes with one copy."""
        if page is not True:
            return page
        if slot is not None and used == node.num_tokens:
            raw = self.state.tiers.raw_page(self.spec, tier, slot, used)
            if raw is not None:
                return raw
        return out[:, :, a:b] if out_array is None else out_array[:, :, a:b]

    def _finish(self, promote: list[tuple[Node, torch.Tensor | np.ndarray]], lost: list[tuple[Node, str]],
                matched: int) -> None:
        """finish (under the lock): promote the lower tiers' hits, unpin, forget the copies found
        lost, count the tokens fetched."""
        state, spec = self.state, self.spec
        with state.lock:
            for node, kv in promote:
                promote_page(state.placement, state.tiers, spec, node, kv)
            self._unpin()
            for node, tier in lost:  # after unpinning: losing a last copy drops the subtree
                if state.index.get(node.key) is node:
                    state.placement.remove_from(node, tier)
            state.drain_lost_copies()
            if self.count:
                state.counters["fetched_tokens"] += max(0, matched - self.start)

    def release(self) -> None:
        """Give the plan up unread: unpin its pages. Nothing once it was run or released."""
        if self._claim():
            with self.state.lock:
                self._unpin()

    def finish_in_place(self, tokens: int) -> None:
        """The caller read tokens [start, tokens) where the pages lie (kvstore/pinned_fetch.py):
        count them as fetched and unpin. Nothing once the plan was run or released."""
        if self._claim():
            with self.state.lock:
                self._unpin()
                if self.count:
                    self.state.counters["fetched_tokens"] += max(0, tokens - self.start)

    def _claim(self) -> bool:
        try:
            return self._unclaimed.pop()
        except IndexError:
            return False

    def _unpin(self) -> None:
        self.state.placement.unpin_all(self.path)


def copy_raw_pages(reads: list[Read], i: int, start: int, buffers: dict[str, np.ndarray], out_rows: np.ndarray,
                   row_bytes: int, copies: list[Copy]) -> int:
    """The copy of read `i`, a raw page in host memory, into the answer's rows (L * 2, T *
    row_bytes), and with it, as one (dst, src) pair, of the whole pages after it that lie right
    after it in the same buffer (a sequence stored at once usually does), appended to `copies`
    (`copy_all` runs them): -> the index of the first read not covered. Slot ranges come from
    the plan: the pages are pinned."""
    node, first, used, tier, slot = reads[i]
    assert slot is not None, "a raw page is read from its slot"
    offset, size = slot
    n = len(node.tokens) // TOKEN_BYTES
    rows = out_rows.shape[0]
    page_width = n * row_bytes  # a page's bytes in one row
    buffer = buffers[tier]
    lo = first if first >= start else start
    a = lo - start
    j = i + 1
    if lo == first and used == n and size == rows * page_width:  # whole, in a slot of its size (not
        j = slot_run_end(reads, i)  # aligned longer): the pages right after it in the buffer join it
        if j - i > 1:
            k = j - i
            # (k pages, rows, width) of the buffer, read row by row into the answer's rows, where
            # the k pages are k consecutive widths (a view: copy=False raises rather than copy).
            copies.append((out_rows[:, a * row_bytes:(a + k * n) * row_bytes].reshape(rows, k, page_width, copy=False),
                           buffer[offset:offset + k * size].reshape(k, rows, page_width).transpose(1, 0, 2)))
            return j
    page_rows = buffer[offset:offset + rows * page_width].reshape(rows, page_width)  # a slot may be longer (aligned)
    if lo > first or used < n:  # part of the page: its tokens [lo - first, used)
        page_rows = page_rows[:, (lo - first) * row_bytes:used * row_bytes]
    copies.append((out_rows[:, a * row_bytes:(first + used - start) * row_bytes], page_rows))
    return j


def slot_run_end(reads: list[Read], i: int) -> int:
    """The index past read `i`, a page in a slot, and the reads right after it that use as many
    tokens of pages in slots of the same size at the next offsets of the same tier's buffer: a
    run of consecutive slots (a sequence stored at once usually is one; only a tail page is
    shorter). The slot ranges come from the plan: the pages are pinned. The one walk over runs,
    for the fetch's copies (`copy_raw_pages`, `copy_raw_slices`) and for pages handed out where
    they lie (kvstore/pinned_fetch.py)."""
    _, _, used, tier, slot = reads[i]
    assert slot is not None, "a run is of pages in slots"
    end, size = slot[0] + slot[1], slot[1]
    j = i + 1
    n = len(reads)
    while j < n:
        _, _, next_used, next_tier, next_slot = reads[j]
        if next_tier != tier or next_slot is None or next_slot[0] != end or next_slot[1] != size or next_used != used:
            break
        end += size
        j += 1
    return j


def copy_raw_slices(reads: list[Read], i: int, start: int, buffers: dict[str, np.ndarray], out_rows: np.ndarray,
                    spec: ModelSpec, part: PageSlice, copies: list[Copy]) -> int:
    """`copy_raw_pages` for a slice of the pages (a tensor-parallel rank's KV heads, a pipeline
    stage's layers): read `i` and the whole pages after it that lie right after it in the same
    buffer, as one strided copy from the slots straight into the answer's rows, which hold the
    slice's rows of (T, heads, D) -> the index of the first read not covered."""
    node, first, used, tier, slot = reads[i]
    assert slot is not None, "a raw page is read from its slot"
    offset = slot[0]
    n = len(node.tokens) // TOKEN_BYTES
    (l0, l1), (h0, h1) = part.layer_range(spec), part.head_range(spec)
    head_bytes = spec.head_dim * spec.itemsize
    all_rows, H = 2 * spec.num_layers, spec.num_kv_heads
    page_bytes = all_rows * n * H * head_bytes
    buffer = buffers[tier]
    lo = first if first >= start else start
    a = lo - start
    j = i + 1
    if lo == first and used == n and slot[1] == page_bytes:  # whole, in a slot of its size (not aligned
        j = slot_run_end(reads, i)  # longer): the pages right after it in the buffer join it
    k = j - i
    # The k pages' slots as (k, rows, n, H) heads, each head's D values one element of a void
    # type (numpy copies an element with one memcpy, where bytes one at a time cost several
    # times more); their slice, rows first, into the answer's rows of (T, heads).
    head = np.dtype((np.void, head_bytes))
    pages = buffer[offset:offset + k * page_bytes].view(head).reshape(k, all_rows, n, H)
    src = pages[:, 2 * l0:2 * l1, lo - first:used, h0:h1].transpose(1, 0, 2, 3)
    rows, t = src.shape[0], src.shape[2]
    dst = out_rows.view(head).reshape(rows, -1, h1 - h0)[:, a:a + k * t].reshape(rows, k, t, h1 - h0, copy=False)
    copies.append((dst, src))
    return j


def plan_fetch(state: StoreState, root_key: bytes, spec: ModelSpec, tb: bytes, start: int, dev: torch.device, *,
               count: bool = True, into: torch.Tensor | None = None, part: PageSlice = WHOLE) -> FetchPlan:
    """The plan of a fetch of `tb` (int32 LE token bytes) from token `start`, made under the lock."""
    with state.lock:
        state.drain_lost_copies()
        tiers, placement = state.tiers, state.placement
        match = state.index.match(root_key, tb, spec.page_size)
        requested = len(tb) // TOKEN_BYTES
        if count:
            state.counters["fetches"] += 1
            state.counters["requested_tokens"] += requested
        state.count_misses(match.path, requested > match.matched_tokens)
        if match.matched_tokens <= start:
            return FetchPlan(state, spec, start, dev, into, count, [], [], match.matched_tokens, False, part)
        clock = state.tick()
        reads: list[Read] = []
        needs_io = False
        offset = 0
        matched = match.matched_tokens
        path = match.path
        placement.pin_all(path)
        placement.touch_all(path, clock)  # before this request's hits count (a policy reads them)
        source_tier, slot_of, usage = tiers.source_tier, tiers.slot, placement.usage
        for node in path:
            used = len(node.tokens) // TOKEN_BYTES
            if used > matched - offset:
                used = matched - offset
            tier = source_tier(node)
            if offset + used > start:
                usage[tier].hits += 1
                node.hits += 1
                slot = slot_of(tier, node.key)
                if slot is None:  # a record
                    needs_io = True
                reads.append((node, offset, used, tier, slot))
            offset += used
        return FetchPlan(state, spec, start, dev, into, count, path, reads, matched, needs_io, part)
