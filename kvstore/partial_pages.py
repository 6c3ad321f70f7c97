"""The staging area of pages written in parts (kvstore/page_parts.py): each page's buffer, which
of its (layer, KV head) cells are claimed and written, and when it is given up.

Invariants (under the store's lock): a page is here from its first part until it is whole (then
stored) or its `deadline` passes (then dropped); `nbytes` is the sum of the buffers held, at
most `max_bytes`; the dict's order is the pages' creation order, which is deadline order (one
timeout for all), so expiry looks only at its head.
"""
from __future__ import annotations

import time

import numpy as np
import torch

from kvstore.gpu.dtypes import KV_DTYPES
from kvstore.config import ModelSpec
from kvstore.page_slice import PageSlice


class PartialPage:
    """One page's staging buffer and which of its (layer, head) cells are claimed and written."""

    __slots__ = ("kv", "claimed", "written", "parts", "deadline", "nbytes")

    def __init__(self, spec: ModelSpec, num_tokens: int, deadline: float):
        self.kv = torch.empty(spec.kv_shape(num_tokens), dtype=KV_DTYPES[spec.dtype])
        self.claimed = np.zeros((spec.num_layers, spec.num_kv_heads), dtype=bool)  # (layer, KV head) cells
        self.written = np.zeros((spec.num_layers, spec.num_kv_heads), dtype=bool)
        self.parts: set[PageSlice] = set()  # the parts claimed so far
        self.deadline = deadline
        self.nbytes = self.kv.numel() * self.kv.element_size()

    def cells(self, part: PageSlice, spec: ModelSpec) -> tuple[slice, slice]:
        (l0, l1), (h0, h1) = part.layer_range(spec), part.head_range(spec)
        return slice(l0, l1), slice(h0, h1)

    @property
    def whole(self) -> bool:
        return bool(self.written.all())


class PageParts:
    """The pages being written in parts, keyed by page key, oldest first (under the store's lock)."""

    def __init__(self, timeout_s: float, max_bytes: int):
        self.timeout_s, self.max_bytes = timeout_s, max_bytes
        self.pages: dict[bytes, PartialPage] = {}  # insertion order is deadline order
        self.nbytes = 0
        self.expired = 0  # pages given up, for stats

    def expire(self, now: float | None = None) -> None:
        """Give up the pages whose time ran out (a rank that failed or was killed mid-store)."""
        if not self.pages:
            return
        now = time.monotonic() if now is None else now
        while self.pages:
            key, page = next(iter(self.pages.items()))
            if page.deadline > now or page.whole:  # a whole page is being stored: its writer forgets it
                break
            self.forget(key)
            self.expired += 1

    def forget(self, key: bytes) -> None:
        page = self.pages.pop(key, None)
        if page is not None:
            self.nbytes -= page.nbytes

    def new_page(self, key: bytes, spec: ModelSpec, num_tokens: int) -> PartialPage | None:
        """A staging buffer for the page `key`, or None when it would pass `max_bytes`."""
        nbytes = num_tokens * spec.bytes_per_token
        if self.nbytes + nbytes > self.max_bytes:
            return None
        page = self.pages[key] = PartialPage(spec, num_tokens, time.monotonic() + self.timeout_s)
        self.nbytes += page.nbytes
        return page
