"""KVStore: the in-process store, and the orchestrator of tiers.

It owns the page tree (`PageIndex`), the model registry and `Placement` (which decides where
pages live); the tiers only hold bytes. One lock guards the tree and placement; the big copies
(encoding a page into a slot, decoding one out) run outside it on pinned pages, so threads copy
in parallel and a pinned page's bytes cannot be reused under them.

    store  -> validate everything -> plan new pages under the lock (pin, reserve slots)
           -> encode KV into the slots outside the lock -> mark ready, unpin, write through
    fetch  -> match and pin under the lock -> decode pages into one output tensor outside it
           -> promote lower-tier hits to the top tier, unpin

With a shared Redis tier, lookup and fetch first probe Redis (outside the lock) for the chained
keys of the pages past the local match, which other sidecars stored, and add those to the tree
as held in "redis"; store writes every new page through to Redis (write-behind, not waited for).

Placement of a new page: the top configured tier (gpu, else cpu, else disk) that can make room.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from kvstore.codecs import TORCH_DTYPES
from kvstore.config import ModelSpec, StoreConfig
from kvstore.copy import copy_into, host_array
from kvstore.errors import InsufficientStorage, InvalidModelSpec, PayloadTooLarge
from kvstore.host_memory import empty_host
from kvstore.index import TOKEN_BYTES, Node, PageIndex
from kvstore.keys import chunk_key, page_key
from kvstore.placement import Placement
from kvstore.rebuild import rebuild_index
from kvstore.registry import Model, ModelRegistry
from kvstore.rerotate import check_rerotatable, rerotate_into
from kvstore.results import BlendResult, FetchResult, LookupResult, StoreResult
from kvstore.tier_stack import TierStack
from kvstore.validation import (check_chunks, check_device, check_into, check_kv, check_model_name, check_start,
                                check_start_pos, token_bytes)
from kvstore.tiers.base import PageRecord, WriteTicket

log = logging.getLogger("kvstore.store")

MAX_TOKENS = 1 << 21  # per request; longer prompts are refused before any work
CPU = torch.device("cpu")
MIN_BLEND_LIMIT_BYTES = 1 << 30  # a blend answer may hold this much KV, or the memory tiers' capacity if more


class KVStore:
    """The store API of docs/design.md §7.1. Thread-safe; use as a context manager or call `close()`."""

    def __init__(self, config: StoreConfig | None = None):
        self.config = config = config or StoreConfig()
        self._lock = threading.RLock()
        self._index = PageIndex()
        self._registry = ModelRegistry(config.data_dir if config.disk_bytes else None)
        self._tiers = tiers = TierStack(config, self._registry)
        self._placement = Placement(self._index, tiers.capacities, config.policy, mover=tiers,
                                    size_in=tiers.size_in, raw_size_in=tiers.raw_size_in,
                                    tenant_of=self._registry.tenants_by_namespace.get)
        tiers.placement = self._placement
        self._clock = 0
        self._counters = {"lookups": 0, "fetches": 0, "stores": 0, "lookup_hit_tokens": 0,
                          "fetched_tokens": 0, "stored_pages": 0, "requested_tokens": 0}
        self._closed = False
        if tiers.persistent is not None:
            rebuild_index(self._index, self._placement, self._registry, tiers.tiers[tiers.persistent])

    # -- lifecycle -------------------------------------------------------------------------
    def __enter__(self) -> "KVStore":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def close(self) -> None:
        """Write memory-only pages to disk, flush the disk writer and close every tier.
        Idempotent. (A crash, unlike close, loses what write-back had not yet demoted.)"""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._tiers.save_memory_pages(self._index)
            self._tiers.close()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued tier writes (the disk writer, Redis' write-behind) are done, e.g.
        before reading the disk from another process. False if `timeout_s` ran out first."""
        return self._tiers.flush(timeout_s)

    # -- models ----------------------------------------------------------------------------
    def register_model(self, model: str, spec: ModelSpec, *, tenant: str | None = None) -> ModelSpec:
        """Register `model` with `spec`; idempotent. A different spec raises ModelConflict."""
        check_model_name(model)
        if not isinstance(spec, ModelSpec):
            raise InvalidModelSpec(f"spec: expected a ModelSpec, got {type(spec).__name__}", field="spec")
        with self._lock:
            self._registry.register(model, spec, tenant)
        return spec

    def register_model_created(self, model: str, spec: ModelSpec, *, tenant: str | None = None) -> bool:
        """Like register_model; True when this call created the registration (HTTP 201)."""
        check_model_name(model)
        with self._lock:
            return self._registry.register(model, spec, tenant)[1]

    def get_spec(self, model: str, *, tenant: str | None = None) -> ModelSpec:
        with self._lock:
            return self._registry.get(check_model_name(model), tenant).spec

    def drop_model(self, model: str, *, tenant: str | None = None) -> int:
        """Forget the model and drop its pages (prefix and chunk pages) from every tier."""
        with self._lock:
            entry = self._registry.remove(check_model_name(model), tenant)
            dropped = 0
            for root in [r for r in self._index.roots.values() if r.namespace == entry.namespace]:
                for child in list(root.children.values()):
                    if not self._pinned_below(child):
                        dropped += self._placement.drop(child)
            return dropped

    def set_tenant_quota(self, tenant: str, max_bytes: int | None) -> None:
        """Cap what `tenant` holds in each memory tier (gpu, cpu) at `max_bytes` (None: no cap):
        past it, its own least recently used pages make room, never other tenants'."""
        if not isinstance(tenant, str) or not tenant:
            raise ValueError("tenant: expected a non-empty string")
        if max_bytes is not None and (isinstance(max_bytes, bool) or not isinstance(max_bytes, int) or max_bytes < 0):
            raise ValueError(f"max_bytes: expected a byte count >= 0 or None, got {max_bytes!r}")
        with self._lock:
            self._placement.set_quota(tenant, max_bytes)

    def learn_later(self, on: bool = True) -> None:
        """Let the eviction policy hold what it learns from each request (`duel`'s shadow caches,
        most of its cost) until `catch_up()`, so a caller can answer first and learn after. What
        the tiers hold and which page goes next stay current; only the policy's choice of rule
        lags. The sidecar does this; an engine calling the store in-process need not."""
        with self._lock:
            self._placement.learn_later(on)

    def catch_up(self, blocking: bool = True) -> bool:
        """Do the learning `learn_later` held back. False if `blocking` is False and another
        thread holds the store's lock (nothing was done)."""
        if not self._lock.acquire(blocking):
            return False
        try:
            self._placement.catch_up()
        finally:
            self._lock.release()
        return True

    def _pinned_below(self, node: Node) -> bool:
        return any(page.pins for page in self._index.subtree(node))

    def _model(self, model: str, tenant: str | None) -> Model:
        return self._registry.get(check_model_name(model), tenant)

    # -- lookup ----------------------------------------------------------------------------
    def lookup(self, model: str, tokens: Sequence[int], *, tenant: str | None = None) -> LookupResult:
        """How many leading tokens the store holds, and which tier would serve them."""
        with self._lock:
            entry = self._model(model, tenant)
        tb = token_bytes(tokens, max_tokens=MAX_TOKENS)
        self._probe_shared(entry.namespace, entry.spec, tb)
        with self._lock:
            self._drain_lost_copies()
            match = self._index.match(entry.namespace, tb, entry.spec.page_size)
            tiers: dict[str, int] = {}
            done = 0
            for node in match.path:
                used = min(node.num_tokens, match.matched_tokens - done)
                tier = self._tiers.source_tier(node)
                if not self._tiers.tiers[tier].available:
                    break  # Redis is unreachable: a fetch could not serve these pages now
                tiers[tier] = tiers.get(tier, 0) + used
                done += used
            self._counters["lookups"] += 1
            self._counters["lookup_hit_tokens"] += done
            return LookupResult(done, tiers)

    @property
    def has_shared_tier(self) -> bool:
        """True with a Redis tier: lookup and fetch may then do network I/O (probing Redis)."""
        return self._tiers.shared is not None

    def stores_in_memory(self, nbytes: int) -> bool:
        """Whether storing `nbytes` of new KV now would only copy into memory: write-back, a
        memory top tier, and no eviction that writes a record tier (the disk writer's bounded
        queue can block). Like `in_memory_bytes`, it lets the sidecar skip the thread hop."""
        top = self._tiers.top
        if self.config.durability != "write-back" or not self._tiers.keeps_slots(top):
            return False
        if all(tier.keeps_slots for tier in self._tiers.tiers.values()):
            return True  # evictions only drop pages
        with self._lock:
            return not self._placement.quotas and self._placement.fits(top, nbytes)

    # -- fetch -----------------------------------------------------------------------------
    def fetch_in_memory(self, model: str, tokens: Sequence[int], *, max_bytes: int, start: int = 0,
                        tenant: str | None = None, into: torch.Tensor | None = None) -> FetchResult | None:
        """`fetch` (to the CPU), done only if it needs no I/O and returns at most `max_bytes`:
        every page it would read is in a memory tier and no Redis probe is due. None otherwise,
        with nothing done or counted. The sidecar runs these on its event loop, where the copy
        costs less than a hop to a pool thread and back."""
        if self.has_shared_tier:
            return None  # a fetch may probe Redis for pages past the local match
        entry = self._model(model, tenant)
        tb = token_bytes(tokens, max_tokens=MAX_TOKENS)
        start = check_start(start, len(tb) // TOKEN_BYTES)
        return self._fetch(entry.namespace, entry.spec, tb, start, CPU, into=check_into(into, CPU),
                           memory_only_max_bytes=max_bytes)

    def fetch(self, model: str, tokens: Sequence[int], *, start: int = 0, tenant: str | None = None,
              device: str = "cpu", into: torch.Tensor | None = None) -> FetchResult:
        """KV of the longest cached prefix: `kv` covers tokens[start:matched_tokens].

        `into`: a flat uint8 CPU tensor the answer is written into (then `kv` views its first
        bytes) when it is large enough; a fresh tensor otherwise. The sidecar passes a region of
        a client's shared memory here, an engine its own staging buffer."""
        entry = self._model(model, tenant)
        tb = token_bytes(tokens, max_tokens=MAX_TOKENS)
        start = check_start(start, len(tb) // TOKEN_BYTES)
        dev = check_device(device)
        return self._fetch(entry.namespace, entry.spec, tb, start, dev, into=check_into(into, dev))

    def _fetch(self, root_key: bytes, spec: ModelSpec, tb: bytes, start: int, dev: torch.device,
               *, count: bool = True, into: torch.Tensor | None = None,
               memory_only_max_bytes: int | None = None) -> FetchResult | None:
        self._probe_shared(root_key, spec, tb)
        with self._lock:
            self._drain_lost_copies()
            match = self._index.match(root_key, tb, spec.page_size)
            if memory_only_max_bytes is not None and (
                    (match.matched_tokens - start) * spec.bytes_per_token > memory_only_max_bytes
                    or any(not self._tiers.keeps_slots(self._tiers.source_tier(node)) for node in match.path)):
                return None  # fetch_in_memory: this one needs I/O or is too big
            if count:
                self._counters["fetches"] += 1
                self._counters["requested_tokens"] += len(tb) // TOKEN_BYTES
            self._count_misses(match.path, len(tb) // TOKEN_BYTES > match.matched_tokens)
            if match.matched_tokens <= start:
                return FetchResult(match.matched_tokens, self._empty_kv(spec, dev))
            self._clock += 1
            reads = []  # (node, first token, tokens used, tier, slot view or None)
            offset = 0
            for node in match.path:
                used = min(node.num_tokens, match.matched_tokens - offset)
                self._placement.pin(node)
                self._placement.touch(node, self._clock)
                tier = self._tiers.source_tier(node)
                if offset + used > start:
                    self._placement.usage[tier].hits += 1
                    node.hits += 1
                    slot = self._tiers.slot(tier, node.key)
                    reads.append((node, offset, used, tier, slot))
                offset += used
        shape, dtype = spec.kv_shape(match.matched_tokens - start), TORCH_DTYPES[spec.dtype]
        nbytes = (match.matched_tokens - start) * spec.bytes_per_token
        if into is not None and into.numel() >= nbytes:
            out = into[:nbytes].view(dtype).view(shape)  # (L, 2, T, H, D)
        else:
            out = empty_host(shape, dtype) if dev.type == "cpu" else torch.empty(shape, dtype=dtype, device=dev)
        matched = match.matched_tokens
        promote: list[tuple[Node, torch.Tensor]] = []
        lost: list[tuple[Node, str]] = []  # record copies that could not be read
        records: dict[bytes, PageRecord | None] = {}
        stream = self._tiers.record_batches(reads, spec, out, start)  # payloads land in `out` where they can
        out_array = host_array(out)
        try:
            for node, first, used, tier, slot in reads:
                lo = max(first, start)  # tokens [lo, first + used) of the prompt come from this page
                whole = lo == first and used == node.num_tokens
                raw = self._tiers.slot_array(spec, tier, slot, used) \
                    if whole and slot is not None and out_array is not None else None
                if raw is not None:  # a whole raw page in host memory: numpy copies it
                    np.copyto(out_array[:, :, lo - start:first + used - start], raw, casting="no")
                    page: torch.Tensor | bool | None = True
                else:
                    if slot is None and node.key not in records:
                        records = next(stream, {})
                    page = self._tiers.read_page(spec, node, tier, slot, records.pop(node.key, None), whole=whole,
                                                 out=out[:, :, lo - start:first + used - start])
                if page is None:  # the copy went bad (corrupt, evicted by Redis, unreachable): serve what came before it
                    lost.append((node, tier))
                    matched = first
                    break
                if page is not True:
                    copy_into(out[:, :, lo - start:first + used - start], page[:, :, lo - first:used])
                if tier != self._tiers.top and self.config.promote_on_hit and lo == first:
                    promote.append((node, out[:, :, lo - start:first + used - start] if page is True else page))
        finally:
            with self._lock:
                for node, kv in promote:
                    self._tiers.promote(spec, node, kv)
                for node in match.path:
                    self._placement.unpin(node)
                for node, tier in lost:  # after unpinning: losing a last copy drops the subtree
                    if self._index.get(node.key) is node:
                        self._placement.remove_from(node, tier)
                self._drain_lost_copies()
        if count:
            self._counters["fetched_tokens"] += max(0, matched - start)
        if matched <= start:
            return FetchResult(matched, self._empty_kv(spec, dev))
        return FetchResult(matched, out[:, :, :matched - start])

    # -- store -----------------------------------------------------------------------------
    def store(self, model: str, tokens: Sequence[int], kv: Any, *, start: int = 0,
              tenant: str | None = None) -> StoreResult:
        """Store KV for tokens[start:] (the store must already hold tokens[:start])."""
        entry = self._model(model, tenant)
        tb = token_bytes(tokens, max_tokens=MAX_TOKENS)
        n_tokens = len(tb) // TOKEN_BYTES
        start = check_start(start, n_tokens)
        kv = check_kv(kv, entry.spec, n_tokens - start)
        self._counters["stores"] += 1
        return self._store(entry.namespace, entry.namespace, entry.spec, tb, kv, start)

    def store_chunk(self, model: str, tokens: Sequence[int], kv: Any, *, tenant: str | None = None) -> StoreResult:
        """Store a chunk's KV computed standalone at positions 0..n-1 (CacheBlend), under its
        position-independent chunk key: the chunk is a prefix tree of its own."""
        entry = self._model(model, tenant)
        tb = token_bytes(tokens, max_tokens=MAX_TOKENS)
        kv = check_kv(kv, entry.spec, len(tb) // TOKEN_BYTES)
        self._counters["stores"] += 1
        return self._store(chunk_key(entry.namespace, tb), entry.namespace, entry.spec, tb, kv, 0)

    def blend(self, model: str, chunks: Sequence[Sequence[int]], *, start_pos: int = 0,
              tenant: str | None = None, device: str = "cpu") -> BlendResult:
        """The chunks' stored KV laid end to end from position `start_pos`, K re-rotated to those
        positions (CacheBlend). A chunk hits only if the store holds all of it; a missed chunk's
        KV is zeros, for the caller to compute (standalone) and `store_chunk`."""
        entry = self._model(model, tenant)
        check_rerotatable(entry.spec)  # before any work: never hand out KV at wrong positions
        tbs = check_chunks(chunks, max_tokens=MAX_TOKENS)
        start_pos = check_start_pos(start_pos)
        dev = check_device(device)
        lengths = [len(tb) // TOKEN_BYTES for tb in tbs]
        # Misses cost the store nothing but zeros in the answer: bound the answer, not only the hits.
        limit = max(MIN_BLEND_LIMIT_BYTES, self.config.cpu_bytes + self.config.gpu_bytes)
        if sum(lengths) * entry.spec.bytes_per_token > limit:
            raise PayloadTooLarge(f"chunks: {sum(lengths)} tokens of KV are {sum(lengths) * entry.spec.bytes_per_token} "
                                  f"bytes, over the blend limit of {limit} bytes (the memory tiers' capacity)",
                                  field="chunks")
        kv = torch.empty(entry.spec.kv_shape(sum(lengths)), dtype=TORCH_DTYPES[entry.spec.dtype], device=dev)  # (L, 2, T, H, D)
        hits, positions, offset = [], [], 0
        for tb, n in zip(tbs, lengths):
            found = self._fetch(chunk_key(entry.namespace, tb), entry.spec, tb, 0, dev)
            hits.append(found.matched_tokens == n)  # a partial chunk is a miss: its KV is all or nothing
            if hits[-1]:
                rerotate_into(kv[:, :, offset:offset + n], found.kv, entry.spec, start_pos + offset)
            else:
                kv[:, :, offset:offset + n].zero_()
            positions.append((start_pos + offset, start_pos + offset + n))
            offset += n
        return BlendResult(hits, kv, positions)

    def _store(self, root_key: bytes, namespace: bytes, spec: ModelSpec, tb: bytes, kv: torch.Tensor,
               start: int) -> StoreResult:
        P = spec.page_size
        n_tokens = len(tb) // TOKEN_BYTES
        page_start = start // P * P
        if page_start < start:
            # The page holding `start` is partly cached already: take those tokens' KV from the
            # store, so every stored page is whole.
            head = self._fetch(root_key, spec, tb[:start * TOKEN_BYTES], page_start, kv.device, count=False)
            if head.matched_tokens < start:
                return StoreResult(head.matched_tokens, 0)
            kv = torch.cat([head.kv.to(kv.device), kv], dim=2)
            start = page_start
        writes: list[tuple[Node, str, torch.Tensor | None, int, int]] = []
        path: list[Node] = []
        stored_tokens = 0
        with self._lock:
            self._drain_lost_copies()
            self._clock += 1
            parent = self._index.root(root_key, namespace)
            for s in range(0, n_tokens, P):
                e = min(s + P, n_tokens)
                ptoks = tb[s * TOKEN_BYTES:e * TOKEN_BYTES]
                key = page_key(parent.key, ptoks)
                node = self._index.get(key) or (self._covering_sibling(parent, ptoks) if e - s < P else None)
                if node is not None:
                    if node.parent is not parent or not node.tokens.startswith(ptoks) or not (node.ready or node.pins):
                        break  # a key collision or a page on its way out: stop here, store nothing wrong
                    self._placement.pin(node)
                    self._placement.touch(node, self._clock)
                    path.append(node)
                    parent = node
                    stored_tokens = e
                    continue
                if s < start:
                    break  # the caller's prefix is no longer cached: nothing after it can chain
                tier, nbytes, slot = self._tiers.reserve(spec, key, e - s, namespace)
                if tier is None:
                    if not writes:
                        raise InsufficientStorage("store: no tier has room for a page (every page is pinned, or the tenant's max_bytes is below a page)")
                    break
                node = self._index.insert(parent, key, ptoks, tail=e - s < P)
                self._placement.pin(node)
                self._placement.touch(node, self._clock)
                self._placement.add(node, tier, nbytes)
                path.append(node)
                writes.append((node, tier, slot, s, e))
                parent = node
                stored_tokens = e
        durable: list[WriteTicket] = []
        shared = self._tiers.shared
        shares: list[tuple[Node, PageRecord]] = []  # write-through to Redis: other sidecars see them
        ok = False
        kv_array = host_array(kv)
        try:
            for node, tier, slot, s, e in writes:
                raw = self._tiers.slot_array(spec, tier, slot, e - s) \
                    if slot is not None and kv_array is not None else None
                if raw is not None:  # a raw page in host memory: numpy copies it in
                    np.copyto(raw, kv_array[:, :, s - start:e - start], casting="no")
                else:
                    ticket = self._tiers.put_page(spec, node, tier, kv=kv[:, :, s - start:e - start], slot=slot)
                    durable.append(ticket)  # type: ignore[arg-type]
                if shared is not None and tier != shared.name and shared.available:
                    shares.append((node, self._tiers.record(spec, node, shared.name, kv=kv[:, :, s - start:e - start])))
            ok = True
        finally:
            with self._lock:
                for node, tier, slot, s, e in writes:
                    if ok:
                        node.ready = True
                        if self.config.durability == "write-through" and tier != self._tiers.persistent:
                            event = self._tiers.write_through(spec, node, kv[:, :, s - start:e - start])
                            if event is not None:
                                durable.append(event)
                        # After the write-through: the disk writer commits in queue order, so a
                        # crash never finds the shorter tail deleted and its replacement unwritten
                        # (an acknowledged sequence ending in that tail would lose its last tokens).
                        self._drop_shadowed_tails(node)
                    else:
                        self._placement.remove_from(node, tier)
                for node, record in shares:  # queued, never waited for: Redis must not slow stores
                    if ok and node.ready and node.tiers and shared.name not in node.tiers:  # type: ignore[union-attr]
                        self._placement.add(node, shared.name, self._tiers.size_in(node, shared.name))  # type: ignore[union-attr]
                        shared.put(record)  # type: ignore[union-attr]
                for node in path:
                    self._placement.unpin(node)
                self._counters["stored_pages"] += len(writes) if ok else 0
        for event in durable:
            event.wait()
        lost = sum(not event.ok for event in durable)
        if lost:  # the disk refused the write (full): the pages are not durable, or not stored at all
            raise InsufficientStorage(f"store: the disk tier could not write {lost} of the pages (disk full?); "
                                      "they are not stored durably")
        return StoreResult(stored_tokens, len(writes))

    def _covering_sibling(self, parent: Node, ptoks: bytes) -> Node | None:
        """A cached sibling whose tokens start with this tail page's: it already serves them."""
        for sibling in parent.by_first.get(ptoks[:TOKEN_BYTES], ()):
            if sibling.ready and len(sibling.tokens) > len(ptoks) and sibling.tokens.startswith(ptoks):
                return sibling
        return None

    def _drop_shadowed_tails(self, node: Node) -> None:
        """A new page makes shorter sibling tail pages it extends redundant: drop them."""
        parent = node.parent
        assert parent is not None
        for sibling in list(parent.by_first.get(node.tokens[:TOKEN_BYTES], ())):
            if sibling is not node and len(sibling.tokens) < len(node.tokens) and not sibling.pins \
                    and not sibling.children and node.tokens.startswith(sibling.tokens):
                self._placement.drop(sibling)

    # -- the shared tier (Redis) -----------------------------------------------------------
    def _probe_shared(self, root_key: bytes, spec: ModelSpec, tb: bytes) -> None:
        """Add the pages past the local match that Redis holds (other sidecars stored them) to
        the tree, as held in "redis": lookup then reports them and fetch serves and promotes them.

        Page keys are chained hashes of the tokens, so they are computed here without any index.
        Redis I/O (pipelined EXISTS) runs outside the lock; the tree is re-checked under it.
        Token ids are verified when a page is read (`_read_page`): a collision is a miss."""
        shared = self._tiers.shared
        if shared is None or not shared.available:
            return
        P = spec.page_size
        n_tokens = len(tb) // TOKEN_BYTES
        page_bytes = P * TOKEN_BYTES
        with self._lock:
            # The leading full pages the tree holds, walked by their tokens: the pages
            # `PageIndex.match` finds by chained hash (a node's key is the hash of its parent's key
            # and its tokens), without hashing a prompt that `_fetch` then matches (and hashes)
            # again; a prompt held in full returns here at the cost of dict lookups.
            full, anchor = 0, root_key
            node = self._index.roots.get(root_key)
            while node is not None and (full + 1) * P <= n_tokens:
                ptoks = tb[full * page_bytes:(full + 1) * page_bytes]
                node = next((child for child in node.by_first.get(ptoks[:TOKEN_BYTES], ())
                             if child.ready and child.tokens == ptoks), None)
                if node is not None:
                    full += 1
                    anchor = node.key
        if full * P >= n_tokens:
            return
        pages: list[tuple[bytes, bytes]] = []  # (key, tokens) of each page probed, in order

        def keys() -> Iterator[bytes]:
            key = anchor
            for s in range(full * P, n_tokens, P):
                ptoks = tb[s * TOKEN_BYTES:min(s + P, n_tokens) * TOKEN_BYTES]
                key = page_key(key, ptoks)
                pages.append((key, ptoks))
                yield key

        found = shared.probe(keys())  # keys are hashed lazily: a cold long prompt costs one batch
        if not found:
            return
        with self._lock:
            parent = self._index.get(anchor) if full else self._index.roots.get(root_key)
            if parent is None and not full and root_key in self._registry.specs_by_namespace:
                parent = self._index.root(root_key)
            if parent is None or not parent.ready:
                return  # the anchor left meanwhile: the next request probes again
            self._clock += 1
            for key, ptoks in pages[:found]:
                node = self._index.get(key)
                if node is None:
                    node = self._index.insert(parent, key, ptoks, tail=len(ptoks) < spec.page_size * TOKEN_BYTES)
                    node.ready = True
                    self._placement.add(node, shared.name, self._tiers.size_in(node, shared.name))
                    self._placement.touch(node, self._clock)
                elif node.parent is not parent or not node.ready or node.tokens != ptoks:
                    break  # a concurrent store is writing it, or a collision: stop here
                if node.num_tokens < P:
                    break  # a tail page is a leaf
                parent = node

    # -- helpers ---------------------------------------------------------------------------
    def _count_misses(self, path: list[Node], missed: bool) -> None:
        """Each tier above the one that served a page counts a miss; a page no tier holds is a
        miss everywhere (tiers are consulted top down)."""
        for node in path:
            for tier in self._placement.order:
                if tier in node.tiers:
                    break
                self._placement.usage[tier].misses += 1
        if missed:
            for tier in self._placement.order:
                self._placement.usage[tier].misses += 1

    def _empty_kv(self, spec: ModelSpec, dev: torch.device) -> torch.Tensor:
        return torch.empty(spec.kv_shape(0), dtype=TORCH_DTYPES[spec.dtype], device=dev)  # (L, 2, 0, H, D)

    def _drain_lost_copies(self) -> None:
        """Forget copies a record tier lost on its own (corrupt records, failed writes)."""
        for name, tier in self._tiers.tiers.items():
            for key in tier.take_failed():
                node = self._index.get(key)
                if node is not None:
                    self._placement.remove_from(node, name)

    # -- stats -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per tier: pages, bytes, capacity, hits, misses, evictions; plus request counters."""
        with self._lock:
            tiers = {}
            for name in self._placement.order:
                u = self._placement.usage[name]
                tiers[name] = {"pages": u.pages, "bytes": u.used_bytes, "capacity_bytes": u.capacity_bytes,
                               "hits": u.hits, "misses": u.misses, "evictions": u.evictions,
                               "demotions": u.demotions, "promotions": u.promotions,
                               "codec": self._tiers.codecs[name].name, "saved_bytes": u.saved_bytes}
                extra = self._tiers.tiers[name].stats()  # tier-specific counters (Redis: up, errors, missing pages)
                tiers[name].update({k: v for k, v in extra.items() if k not in tiers[name]})
            tenants: dict[str, dict[str, Any]] = {}  # names only: tokens never reach the store
            for tenant, quota in self._placement.quotas.items():
                tenants[tenant] = {"max_bytes": quota, "bytes": {}}
            for (tier, tenant), nbytes in self._placement.tenant_bytes.items():
                tenants.setdefault(tenant, {"max_bytes": None, "bytes": {}})["bytes"][tier] = nbytes
            corrupt = sum(t.corrupt_records for t in self._tiers.tiers.values())
            return {"tiers": tiers, "pages": len(self._index), "corrupt_records": corrupt,
                    "dropped_pages": self._placement.dropped_pages, "policy": self.config.policy,
                    "models": len(self._registry._models), "tenants": tenants, **self._counters}
