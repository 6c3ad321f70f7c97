"""Pages written in parts: each tensor-parallel rank (or pipeline stage) stores its slice of a
page, and the page enters the store whole once every slice has arrived.

    plan (under the lock)     walk the pages of tokens[start:] by their chained keys: a page the
                              store holds is done (a part of it is a no-op); otherwise claim this
                              part's cells of the page's staging buffer, refusing a part that
                              overlaps a different one (PartConflict, nothing claimed)
    copy (outside the lock)   copy the part into its cells
    publish (under the lock)  mark the cells written; a page whose every cell is written leaves
                              the staging area, and each run of such pages is stored whole
                              (page_writes.store_pages: the one path every page enters a tier by)

A page in parts is in no tier and not in the page tree, so no lookup, fetch, blend or KV event
sees any of it until it is whole. A page not whole `part_timeout_s` after its first part is
given up (its staging memory freed) at the next store, lookup or stats call after that; the
staging area holds at most `part_bytes` (StoreConfig), past which parts are refused
(InsufficientStorage) rather than queued.

Each rank stores its pages in order, so a page's last part arrives after its parent's: the page
before a run of newly whole pages is already stored, and the run chains onto it. A run whose
prefix is no longer stored (evicted meanwhile, or a part that timed out) is dropped: nothing
after a missing page can be matched.

A part equal to one another writer already wrote (two engines at the same degree storing the
same prompt at once, or a rank resending) is a no-op, as a second store of a whole page is. A
part that overlaps a different one is refused: the writers split the page differently.

Read-your-writes for parts: `stored_tokens` of a part store counts the leading pages that are
stored, or that hold this part and wait for the others. Those pages become matchable once their
other parts arrive within `part_timeout_s`; a rank learns nothing of the other ranks' parts.
"""
from __future__ import annotations

from typing import Iterator

import torch

from kvstore.config import ModelSpec
from kvstore.copy_threads import copy_all
from kvstore.errors import InsufficientStorage, PartConflict
from kvstore.host_copy import host_array
from kvstore.host_memory import empty_host
from kvstore.index import TOKEN_BYTES
from kvstore.keys import page_key
from kvstore.page_slice import PageSlice
from kvstore.page_writes import FetchHead, covering_sibling, from_page_start, store_pages
from kvstore.partial_pages import PageParts, PartialPage
from kvstore.results import StoreResult
from kvstore.store_state import StoreState


# A part claimed in a page's staging buffer: (page key, its staging, first token, end token).
Claim = tuple[bytes, PartialPage, int, int]


def store_part(state: StoreState, fetch: FetchHead, root_key: bytes, namespace: bytes, spec: ModelSpec, tb: bytes,
               kv: torch.Tensor, start: int, part: PageSlice) -> StoreResult:
    """Store `kv`, the slice `part` of tokens [start:]'s KV, as parts of their pages."""
    # The page holding `start` must be stored whole already: its first tokens' slice comes from it.
    moved = from_page_start(fetch, root_key, spec, tb, kv, start, part)
    if isinstance(moved, int):
        return StoreResult(moved, 0)
    kv, start = moved
    with state.lock:
        claims, held = plan_parts(state, root_key, spec, tb, start, part)
    ok = False
    try:
        copy_parts(claims, kv, start, part)
        ok = True
    finally:
        with state.lock:
            whole, held = publish_parts(state, claims, spec, part, ok, held)
    new_pages = 0
    try:
        for first, last in _runs(whole):
            s, e = whole[first][2], whole[last - 1][3]
            new_pages += store_pages(state, fetch, root_key, namespace, spec, tb[:e * TOKEN_BYTES],
                                     _joined([page.kv for _, page, _, _ in whole[first:last]]), s).new_pages
    finally:
        with state.lock:
            for key, page, _, _ in whole:
                if state.parts.pages.get(key) is page:
                    state.parts.forget(key)
    return StoreResult(held, new_pages)


def plan_parts(state: StoreState, root_key: bytes, spec: ModelSpec, tb: bytes, start: int,
               part: PageSlice) -> tuple[list[Claim], int]:
    """plan (under the lock): this part's cells claimed in the staging buffers of the pages of
    tokens [start:] the store does not hold -> (the claims, the tokens held: stored, or held
    in parts with this one). Raises PartConflict (nothing claimed) or InsufficientStorage."""
    P, n_tokens = spec.page_size, len(tb) // TOKEN_BYTES
    parts, index = state.parts, state.index
    claims: list[Claim] = []
    held = 0
    state.counters["stores"] += 1
    parts.expire()
    parent_key = root_key
    parent = index.get(root_key)  # None: nothing of this tree is stored yet
    for s in range(0, n_tokens, P):
        e = min(s + P, n_tokens)
        ptoks = tb[s * TOKEN_BYTES:e * TOKEN_BYTES]
        key = page_key(parent_key, ptoks)
        node = index.get(key)
        if node is None and e - s < P and parent is not None:
            node = covering_sibling(parent, ptoks)
        if node is not None and node.tokens.startswith(ptoks):
            # Stored whole, or being stored whole by another writer (every head of it is
            # there): this part adds nothing.
            parts.forget(key)
            parent, parent_key, held = node, key, e
            continue
        parent = None  # past the first page not stored, every page's node is looked up by key only
        page = parts.pages.get(key)
        if page is not None and part in page.parts:
            parent_key, held = key, e  # held already (the caller's prefix), or the same part again: a no-op
            continue
        if s < start:
            break  # the caller's prefix must be held already (stored, or waiting for the other parts)
        if page is None:
            page = parts.new_page(key, spec, e - s)
            if page is None:
                if not claims:
                    raise InsufficientStorage(f"store: the pages waiting for their other parts hold "
                                              f"part_bytes ({parts.max_bytes} bytes); none is taken")
                break
        rows, cols = page.cells(part, spec)
        if page.claimed[rows, cols].any():
            for claimed_key, claimed_page, _, _ in claims:  # nothing of this call stays claimed
                _unclaim(parts, claimed_key, claimed_page, part, spec)
            raise PartConflict(f"{_field(part)}: this part overlaps a different part already stored for "
                               f"the page of tokens [{s}, {e}) (the writers split the page differently: "
                               f"{sorted(map(_show, page.parts))})", field=_field(part))
        page.claimed[rows, cols] = True
        page.parts.add(part)
        claims.append((key, page, s, e))
        parent_key, held = key, e
    return claims, held


def copy_parts(claims: list[Claim], kv: torch.Tensor, start: int, part: PageSlice) -> None:
    """copy (outside the lock): the part, `kv` from token `start`, into its claimed cells."""
    copies = []
    for _, page, s, e in claims:
        dst, src = part.take(page.kv), kv[:, :, s - start:e - start]
        dst_array, src_array = host_array(dst), host_array(src)
        if dst_array is None or src_array is None:
            dst.copy_(src)  # KV on a device: torch brings it to the host
        else:
            copies.append((dst_array, src_array))
    copy_all(copies)


def publish_parts(state: StoreState, claims: list[Claim], spec: ModelSpec, part: PageSlice, ok: bool,
                  held: int) -> tuple[list[Claim], int]:
    """publish (under the lock): the claimed cells written (`ok`), or their claims taken back
    -> (the pages made whole, to be stored; the tokens held)."""
    whole: list[Claim] = []
    for key, page, s, e in claims:
        if not ok:
            _unclaim(state.parts, key, page, part, spec)
            held = min(held, s)
            continue
        rows, cols = page.cells(part, spec)
        page.written[rows, cols] = True
        if page.whole and state.parts.pages.get(key) is page:
            # It stays staged until it is in the tree: a rank's next store, meanwhile, finds its
            # part of this page held (the page is in neither place otherwise).
            whole.append((key, page, s, e))
    return whole, held


def _runs(whole: list[Claim]) -> Iterator[tuple[int, int]]:
    """[first, last) index ranges of `whole` whose pages follow one another."""
    first = 0
    for i in range(1, len(whole) + 1):
        if i == len(whole) or whole[i][2] != whole[i - 1][3]:
            yield first, i
            first = i


def _joined(pages: list[torch.Tensor]) -> torch.Tensor:
    """The pages' KV end to end, (L, 2, T, H, D), copied by numpy (copy_threads.py): torch.cat
    runs on torch's intra-op threads, which a busy host stalls by seconds."""
    if len(pages) == 1:
        return pages[0]
    first = pages[0]
    out = empty_host((*first.shape[:2], sum(p.shape[2] for p in pages), *first.shape[3:]), first.dtype)
    copies, t = [], 0
    for page in pages:
        n = page.shape[2]
        dst, src = host_array(out[:, :, t:t + n]), host_array(page)
        assert dst is not None and src is not None, "staged pages are host tensors"
        copies.append((dst, src))
        t += n
    copy_all(copies)
    return out


def _unclaim(parts: PageParts, key: bytes, page: PartialPage, part: PageSlice, spec: ModelSpec) -> None:
    """Take `part`'s claim on a page back; a page no part claims any more is forgotten."""
    rows, cols = page.cells(part, spec)
    page.claimed[rows, cols] = False
    page.parts.discard(part)
    if not page.parts and parts.pages.get(key) is page:
        parts.forget(key)


def _field(part: PageSlice) -> str:
    return "heads" if part.heads is not None else "layers"


def _show(part: PageSlice) -> str:
    return f"layers={part.layers or 'all'} heads={part.heads or 'all'}"
