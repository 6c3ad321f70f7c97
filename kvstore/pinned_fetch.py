"""A fetch read where its pages lie, for an embedder that rearranges the KV on its way anyway.

`KVStore.fetch` copies the matched pages into one answer, `(L, 2, T, H, D)`. An engine that
then copies that answer into its own paged cache, in its own block arrangement (the vLLM
connector), moves every byte twice. `KVStore.fetch_pinned` plans the same fetch and, when
every page it reads lies raw in a host-memory buffer of the top tier, hands out those pages
where they lie: `runs`, views of the tier's buffer, pinned until `release`. The engine copies
each byte once, from the store's buffer into its blocks. When any page is elsewhere (on disk,
in Redis, encoded by a codec, in a lower tier a hit promotes from) `runs` is None and `fetch`
reads the pages into an answer as `KVStore.fetch` does; the prompt is matched once either way.

A run is `k` whole pages at consecutive slots, `(k, L, 2, P, H, D)`: a sequence stored at once
usually lies in one run, a fragmented one in several. A short last page (a tail) is left out:
the runs cover `in_place_tokens`, the fetch's tokens up to the end of its last whole page.

Invariants: a run's bytes are its pages' from `fetch_pinned` until `release` (the pages are
pinned, so nothing evicts or rewrites them); the caller only reads them. `release` or `fetch`
ends the pin, exactly once; a `PinnedFetch` left unreleased keeps its pages in memory.
"""
from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from kvstore.fetch_plan import FetchPlan, slot_run_end
from kvstore.gpu.dtypes import KV_DTYPES, NUMPY_DTYPES
from kvstore.index import TOKEN_BYTES
from kvstore.results import FetchResult
from kvstore.validation import on_cpu


class PageRun(NamedTuple):
    first: int  # the run's first token, counted from the fetch's `start`
    pages: torch.Tensor  # (k, L, 2, P, H, D): k whole pages in the tier's buffer, read-only


class PinnedFetch:
    """The matched pages of one fetch, pinned. Use as a context manager, or call `release`."""

    __slots__ = ("matched_tokens", "in_place_tokens", "runs", "_plan")

    def __init__(self, plan: FetchPlan):
        self._plan = plan
        self.matched_tokens = plan.matched_tokens  # as `fetch` would answer
        self.runs = page_runs(plan)
        # The tokens the runs cover (from 0, as matched_tokens): whole pages only.
        self.in_place_tokens = plan.start + sum(run.pages.shape[0] for run in self.runs) * plan.spec.page_size \
            if self.runs is not None else plan.start

    def fetch(self) -> FetchResult:
        """The pages copied into an answer, exactly `KVStore.fetch`'s; ends the pin."""
        return self._plan.run()

    def release(self) -> None:
        """Done with the runs: unpin the pages. Nothing once fetched or released."""
        self._plan.finish_in_place(self.in_place_tokens)

    def __enter__(self) -> "PinnedFetch":
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def page_runs(plan: FetchPlan) -> list[PageRun] | None:
    """The plan's pages where they lie, in runs of consecutive slots; None when a page it reads
    is not a raw page in host memory of the top tier (or the answer is not for the CPU)."""
    state, spec, start = plan.state, plan.spec, plan.start
    if not on_cpu(plan.dev) or plan.claimed:
        return None
    tiers = state.tiers
    buffers = tiers.raw_buffers
    promotes = state.config.promote_on_hit
    P = spec.page_size
    page_bytes = P * spec.bytes_per_token
    shape = (spec.num_layers, 2, P, spec.num_kv_heads, spec.head_dim)
    runs: list[PageRun] = []
    reads = plan.reads
    i = 0
    while i < len(reads):
        node, first, used, tier, slot = reads[i]
        if used < P or len(node.tokens) // TOKEN_BYTES < P:
            break  # a tail ends the match: its block is not whole for any engine
        if tier not in buffers or slot is None or (promotes and tier != tiers.top) or first < start \
                or slot[1] < page_bytes or slot[1] % NUMPY_DTYPES[spec.dtype].itemsize:
            return None
        offset, stride = slot
        j = slot_run_end(reads, i)  # the whole pages at the next slots of the same buffer
        runs.append(PageRun(first - start, _pages(buffers[tier], offset, stride, j - i, shape, spec.dtype)))
        i = j
    return runs


def _pages(buffer: np.ndarray, offset: int, stride: int, k: int, shape: tuple[int, ...], dtype: str) -> torch.Tensor:
    """k pages of `shape` at `offset`, `stride` bytes apart in `buffer`, as one torch view."""
    item = NUMPY_DTYPES[dtype].itemsize
    span = buffer[offset:offset + (k - 1) * stride + int(np.prod(shape)) * item]
    typed = torch.from_numpy(span.view(NUMPY_DTYPES[dtype]))
    if typed.dtype != KV_DTYPES[dtype]:
        typed = typed.view(KV_DTYPES[dtype])  # bfloat16, which numpy holds as its bits
    strides = [1]
    for size in reversed(shape[1:]):
        strides.insert(0, strides[0] * size)
    return typed.as_strided((k, *shape), (stride // item, *strides))
