"""Storing a sequence's pages: plan under the lock, copy outside it, publish under it.

    plan (under the lock)     walk the pages of tokens[start:]: pin those already cached, and for
                              each new one insert a node (not ready) and reserve its room in the
                              top tier that has it (a slot, or a record's bytes)
    copy (outside the lock)   encode each new page's KV into its slot, or queue its record
    publish (under the lock)  mark the pages ready, write through (durability), fold shorter
                              tails they extend, queue them for the shared tier, unpin

Tail folding: a sequence may end inside a page (a tail page, fewer than page_size tokens). A
longer tail with the same first tokens serves every prompt the shorter one did, so storing it
drops the shorter one, and a new tail whose tokens a cached sibling already starts with is that
sibling (nothing is stored twice).

Read-your-writes: a store acknowledges (`stored_tokens`) only pages every lookup can match as
it returns. A page another store is still writing (in the tree, not yet `ready`) is neither
counted as stored nor written twice: the store waits under the lock's condition
(`StoreState.published`) until its writer publishes it, or gives it up, and then looks at the
page again (ready: it is cached; gone: this store writes it). A store waits only before it
inserts a page of its own, so two stores never wait on each other. Inside `unless_busy` it
raises StoreBusy instead, with nothing left pinned or counted.

Invariant: a page's node is matchable (`ready`) only after all its bytes are written; a store
that fails midway removes the room it reserved and leaves the cached pages as they were.
"""
from __future__ import annotations

from typing import Callable

import numpy as np
import torch

from kvstore.config import ModelSpec
from kvstore.errors import InsufficientStorage, StoreBusy
from kvstore.copy_threads import Copy, copy_all
from kvstore.host_copy import host_array, host_bytes
from kvstore.index import TOKEN_BYTES, Node, PageIndex
from kvstore.keys import page_key
from kvstore.page_moves import reserve
from kvstore.page_moves import write_through as write_page_through
from kvstore.page_slice import WHOLE, PageSlice
from kvstore.results import FetchResult, StoreResult
from kvstore.store_state import StoreState
from kvstore.tier_stack import TierStack
from kvstore.tiers.base import PageRecord, Slot, WriteTicket

# (root key, spec, token bytes, start, device, count) -> the cached KV of tokens [start:] of them
FetchHead = Callable[[bytes, ModelSpec, bytes, int, torch.device, bool], FetchResult]
# A new page to write: (its node, its tier, its slot there or None (a record), first token, end token).
Write = tuple[Node, str, Slot | None, int, int]


def store_pages(state: StoreState, fetch: FetchHead, root_key: bytes, namespace: bytes, spec: ModelSpec,
                tb: bytes, kv: torch.Tensor, start: int) -> StoreResult:
    """Store `kv` (L, 2, T, H, D) for tokens [start:] of `tb` under the tree `root_key`."""
    moved = from_page_start(fetch, root_key, spec, tb, kv, start)
    if isinstance(moved, int):
        with state.lock:
            state.counters["stores"] += 1
        return StoreResult(moved, 0)
    kv, start = moved
    with state.lock:
        writes, path, stored_tokens = plan_writes(state, root_key, namespace, spec, tb, start)
    durable: list[WriteTicket] = []
    shares: list[tuple[Node, PageRecord]] = []
    ok = False
    try:
        durable, shares = copy_pages(state.tiers, spec, kv, start, writes)
        ok = True
    finally:
        with state.lock:
            stored_tokens = publish(state, spec, kv, start, writes, path, shares, durable, ok, stored_tokens)
    if durable:
        wait_durable(durable)
    return StoreResult(stored_tokens, len(writes))


def plan_writes(state: StoreState, root_key: bytes, namespace: bytes, spec: ModelSpec, tb: bytes,
                start: int) -> tuple[list[Write], list[Node], int]:
    """plan (under the lock): the pages of `tb` past those cached (pinned and touched) inserted,
    not ready, with their room reserved -> (the writes, the pinned path, the tokens it covers)."""
    P = spec.page_size
    n_tokens = len(tb) // TOKEN_BYTES
    tiers, placement, index = state.tiers, state.placement, state.index
    writes: list[Write] = []
    path: list[Node] = []
    stored_tokens = 0
    state.counters["stores"] += 1
    state.drain_lost_copies()
    clock = state.tick()
    parent = index.root(root_key, namespace)
    # Every page comes through here: the calls it makes, bound once.
    find, insert, pin, touch, admit = index.nodes.get, index.insert, placement.pin, placement.touch, placement.admit
    for s in range(0, n_tokens, P):
        e = min(s + P, n_tokens)
        ptoks = tb[s * TOKEN_BYTES:e * TOKEN_BYTES]
        key = page_key(parent.key, ptoks)
        node = find(key) or (covering_sibling(parent, ptoks) if e - s < P else None)
        if node is not None and not node.ready and node.tiers:
            # Nothing of this store's own is inserted yet: past its first new page, every page is new.
            assert not writes, "a store waits only before it writes"
            node = wait_for_writer(state, path, node, parent, ptoks, e - s < P)
        if node is not None:
            if node.parent is not parent or not node.tokens.startswith(ptoks) or not node.ready:
                break  # a key collision or a page on its way out: stop here, store nothing wrong
            pin(node)
            touch(node, clock)
            path.append(node)
            parent = node
            stored_tokens = e
            continue
        if s < start:
            break  # the caller's prefix is no longer cached: nothing after it can chain
        tier, nbytes, slot = reserve(placement, tiers, spec, key, e - s, namespace)
        if tier is None:
            if not writes:
                placement.unpin_all(path)
                raise InsufficientStorage("store: no tier has room for a page (every page is pinned, "
                                          "or the tenant's max_bytes is below a page)")
            break
        node = insert(parent, key, ptoks, tail=e - s < P)
        admit(node, tier, nbytes, clock)
        path.append(node)
        writes.append((node, tier, slot, s, e))
        parent = node
        stored_tokens = e
    return writes, path, stored_tokens


def wait_for_writer(state: StoreState, path: list[Node], node: Node, parent: Node, ptoks: bytes,
                    tail: bool) -> Node | None:
    """The page of `node`, which another store is writing (in the tree, not ready; a page that
    lost its last copy holds no tier), once that store has published it or given it up, looked
    up again (a `tail`: or the cached sibling covering `ptoks`); waits under the lock. Inside
    `unless_busy` raises StoreBusy instead, this store undone (`path` unpinned, its count taken
    back): the caller runs it again."""
    key = node.key
    found: Node | None = node
    while found is not None and not found.ready and found.tiers:
        if state.must_not_wait:
            state.placement.unpin_all(path)
            state.counters["stores"] -= 1
            raise StoreBusy("store: pages of this sequence are being written by another request")
        state.waiting += 1
        try:
            state.published.wait()
        finally:
            state.waiting -= 1
        found = state.index.nodes.get(key) or (covering_sibling(parent, ptoks) if tail else None)
    return found


def copy_pages(tiers: TierStack, spec: ModelSpec, kv: torch.Tensor, start: int,
               writes: list[Write]) -> tuple[list[WriteTicket], list[tuple[Node, PageRecord]]]:
    """copy (outside the lock; the pages are pinned): each new page's KV, `kv` from token
    `start`, into its slot, or its record queued -> (the record tiers' write tickets, the
    records for the shared tier, written once the pages are published)."""
    durable: list[WriteTicket] = []
    shares: list[tuple[Node, PageRecord]] = []  # write-through to Redis: other sidecars see them
    shared = tiers.shared
    # A raw page in host memory (a slot of `raw_buffers`) is copied in by numpy: from contiguous
    # KV as bytes (all of it, or the page's run of each row, a row being a layer's K or V), from
    # strided KV through a typed view. Any other page goes through its tier's codec.
    kv_bytes = host_bytes(kv) if writes else None
    kv_array = host_array(kv) if writes and kv_bytes is None else None
    raw_buffers = tiers.raw_buffers if kv_bytes is not None or kv_array is not None else {}
    copies: list[Copy] = []  # the raw pages' copies, made together (copy_threads.py)
    token_bytes = spec.bytes_per_token
    for node, tier, slot, s, e in writes:
        buffer = raw_buffers.get(tier)
        if buffer is not None and slot is not None:
            dst = buffer[slot[0]:slot[0] + (e - s) * token_bytes]
            copies.append(raw_page_copy(spec, token_bytes, dst, kv_bytes, kv_array, s - start, e - start))
        else:
            ticket = tiers.put_page(spec, node, tier, kv=kv[:, :, s - start:e - start], slot=slot)
            assert ticket is not None, "a page with its room reserved is written"
            durable.append(ticket)
        if shared is not None and tier != shared.name and shared.available:
            shares.append((node, tiers.record(spec, node, shared.name, kv=kv[:, :, s - start:e - start])))
    copy_all(copies)
    return durable, shares


def raw_page_copy(spec: ModelSpec, token_bytes: int, dst: np.ndarray, kv_bytes: np.ndarray | None,
                  kv_array: np.ndarray | None, a: int, b: int) -> Copy:
    """The copy of tokens [a, b) of the KV (`kv_bytes`, its bytes when contiguous, else
    `kv_array`, a typed view; `token_bytes` a token's) into `dst`, a raw page's slot bytes in
    host memory."""
    if kv_bytes is None:
        assert kv_array is not None
        return dst.view(kv_array.dtype).reshape(spec.kv_shape(b - a)), kv_array[:, :, a:b]
    if a == 0 and b * token_bytes == kv_bytes.size:  # the page is all of the KV
        return dst, kv_bytes
    rows = 2 * spec.num_layers  # a row: one layer's K or V, of every token
    row_token_bytes = token_bytes // rows
    return dst.reshape(rows, -1), kv_bytes.reshape(rows, -1)[:, a * row_token_bytes:b * row_token_bytes]


def publish(state: StoreState, spec: ModelSpec, kv: torch.Tensor, start: int, writes: list[Write], path: list[Node],
            shares: list[tuple[Node, PageRecord]], durable: list[WriteTicket], ok: bool, stored_tokens: int) -> int:
    """publish (under the lock): when the copies are done (`ok`), mark the new pages ready,
    write them through (tickets appended to `durable`), fold the shorter tails they extend and
    queue them for the shared tier; else take their room back. Unpins `path` -> the tokens a
    lookup can match now."""
    tiers, placement = state.tiers, state.placement
    write_through = state.config.durability == "write-through"
    for node, tier, _, s, e in writes:
        if ok:
            node.ready = True
            if placement.events is not None:
                placement.events.published(node)
            if write_through and tier != tiers.persistent:
                ticket = write_page_through(placement, tiers, spec, node, kv[:, :, s - start:e - start])
                if ticket is not None:
                    durable.append(ticket)
            # After the write-through: the disk writer commits in queue order, so a crash never
            # finds the shorter tail deleted and its replacement unwritten (an acknowledged
            # sequence ending in that tail would lose its last tokens).
            drop_shadowed_tails(state, node)
        else:
            placement.remove_from(node, tier)
    shared = tiers.shared
    for node, record in shares:  # queued, never waited for: Redis must not slow stores
        assert shared is not None
        if ok and node.ready and node.tiers and shared.name not in node.tiers:
            placement.add(node, shared.name, tiers.size_in(node, shared.name))
            shared.put(record)
    if ok:
        state.counters["stored_pages"] += len(writes)
        # Acknowledge only what a lookup can match now: a page of the path that lost its copy
        # meanwhile (it is pinned, so only a tier's own loss) ends the match there.
        for i, node in enumerate(path):
            if not node.ready:
                stored_tokens = min(stored_tokens, i * spec.page_size)
                break
    placement.unpin_all(path)
    if writes and state.waiting:
        state.published.notify_all()  # stores waiting for these pages look at them again
    return stored_tokens


def wait_durable(durable: list[WriteTicket]) -> None:
    """Wait for the record tiers' writes; raises InsufficientStorage when the disk refused any
    (full): those pages are not durable, or not stored at all."""
    for ticket in durable:
        ticket.wait()
    lost = sum(not ticket.ok for ticket in durable)
    if lost:
        raise InsufficientStorage(f"store: the disk tier could not write {lost} of the pages (disk full?); "
                                  "they are not stored durably")


def from_page_start(fetch: FetchHead, root_key: bytes, spec: ModelSpec, tb: bytes, kv: torch.Tensor, start: int,
                    part: PageSlice = WHOLE) -> tuple[torch.Tensor, int] | int:
    """`kv` (of `part`'s layers and heads) and `start` moved back to the start of the page that
    holds `start`, that page's tokens before `start` taken from the store, so every stored page
    is whole; or, when the store no longer holds those tokens, how many it holds."""
    page_start = start // spec.page_size * spec.page_size
    if page_start == start:
        return kv, start
    head = fetch(root_key, spec, tb[:start * TOKEN_BYTES], page_start, kv.device, False)
    if head.matched_tokens < start:
        return head.matched_tokens
    return torch.cat([part.take(head.kv).to(kv.device), kv], dim=2), page_start


def covering_sibling(parent: Node, ptoks: bytes) -> Node | None:
    """A cached sibling whose tokens start with this tail page's: it already serves them."""
    for sibling in PageIndex.children_extending(parent, ptoks):
        if sibling.ready and len(sibling.tokens) > len(ptoks):
            return sibling
    return None


def drop_shadowed_tails(state: StoreState, node: Node) -> None:
    """A new page makes shorter sibling tail pages it extends redundant: drop them (under the lock)."""
    parent = node.parent
    assert parent is not None
    for sibling in PageIndex.children_prefixing(parent, node.tokens):
        if not sibling.pins and not sibling.children:
            state.placement.drop(sibling)
