"""KVStore: the in-process store API, the façade over the store's parts.

It owns the shared state (kvstore/store_state.py: the page tree, placement, the tiers, the model
registry, one lock); each operation lives in the module named after it:

    store  -> validate everything -> page_writes.store_pages: plan new pages under the lock (pin,
              reserve room), encode KV outside it, publish (ready, write through) under it
    fetch  -> validate -> shared_probe (with a shared tier) -> fetch_plan.plan_fetch: match and pin
              under the lock -> FetchPlan.run: decode pages into one answer outside it, promote
              lower-tier hits, unpin
    fetch_pinned -> the same plan; pinned_fetch.PinnedFetch hands out the pages where they lie
              in the CPU tier's buffer (an engine copies them into its own layout, once), or
              runs the plan when a page is elsewhere
    blend  -> blend.blend_chunks: each chunk fetched whole, K re-rotated to its new position
    stats  -> store_stats

With a shared Redis tier, lookup and fetch first probe Redis (outside the lock) for the pages
past the local match that other sidecars stored (shared_probe.py); store writes every new page
through to Redis (write-behind, not waited for). Placement of a new page: the top configured
tier (gpu, else cpu, else disk) that can make room.
"""
from __future__ import annotations

import logging
from typing import Any, Sequence

import torch

from kvstore.limits import MAX_TOKENS
from kvstore.blend import blend_chunks
from kvstore.config import ModelSpec, StoreConfig
from kvstore.errors import InvalidModelSpec
from kvstore.fetch_plan import FetchPlan, plan_fetch
from kvstore.index import TOKEN_BYTES
from kvstore.keys import chunk_key, salt_root
from kvstore.kv_events.recorder import KVEventRecorder, KVEventSink
from kvstore.page_moves import save_memory_pages
from kvstore.page_parts import store_part
from kvstore.page_slice import WHOLE, PageSlice
from kvstore.page_writes import store_pages
from kvstore.pinned_fetch import PinnedFetch
from kvstore.rebuild import rebuild_index
from kvstore.registry import Model
from kvstore.rerotate import check_rerotatable
from kvstore.results import AuditReport, BlendResult, FetchResult, LookupResult, StoreResult
from kvstore.shared_probe import probe_shared
from kvstore.store_audit import check_chunk_flag, check_layer, check_passed, check_tier_name, record_audit
from kvstore.store_state import StoreState
from kvstore.store_stats import store_stats
from kvstore.validation import (CPU, check_chunks, check_device, check_into, check_kv, check_model_name, check_start,
                                check_salt, check_start_pos, token_bytes)


log = logging.getLogger("kvstore.store")


class KVStore:
    """The store API of docs/design.md §7.1. Thread-safe; use as a context manager or call `close()`."""

    def __init__(self, config: StoreConfig | None = None):
        self.config = config = config or StoreConfig()
        self._state = state = StoreState(config)
        # The parts, by the names tests and tools reach them by.
        self._lock, self._index, self._registry = state.lock, state.index, state.registry
        self._tiers, self._placement = state.tiers, state.placement
        self._closed = False
        if self._tiers.persistent is not None:
            rebuild_index(self._index, self._placement, self._registry, self._tiers.tiers[self._tiers.persistent])

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
            saved = save_memory_pages(self._placement, self._tiers, self._index)
            if saved:
                log.info("close: %d memory-only pages written to %s", saved, self._tiers.persistent)
            if self._placement.events is not None:
                self._placement.events.cleared()  # a closed store serves nothing
            self._tiers.close()

    def flush(self, timeout_s: float | None = None) -> bool:
        """Wait until queued tier writes (the disk writer, Redis' write-behind) are done, e.g.
        before reading the disk from another process. False if `timeout_s` ran out first."""
        return self._tiers.flush(timeout_s)

    # -- KV events (kvstore/kv_events/recorder.py, docs/kv_events.md) ---------------------------
    def attach_kv_events(self, sink: KVEventSink) -> None:
        """Report every page entering or leaving a tier to `sink`, from now on; it first gets
        the store's whole picture (`sink.reset`: AllBlocksCleared, then every page per tier)."""
        with self._lock:
            if self._placement.events is None:
                self._placement.events = KVEventRecorder(self._registry)
            self._placement.events.attach(sink, self._index)

    def detach_kv_events(self, sink: KVEventSink) -> None:
        with self._lock:
            recorder = self._placement.events
            if recorder is not None:
                recorder.detach(sink)
                if not recorder.sinks:
                    self._placement.events = None  # nothing listens: placement reports nothing

    def resync_kv_events(self, sink: KVEventSink) -> None:
        """Hand an attached `sink` the whole picture again (`sink.reset`), e.g. after it dropped records."""
        with self._lock:
            recorder = self._placement.events
            if recorder is not None and sink in recorder.sinks:
                sink.reset(recorder.snapshot(self._index))

    # -- models ----------------------------------------------------------------------------
    def register_model(self, model: str, spec: ModelSpec, *, tenant: str | None = None) -> ModelSpec:
        """Register `model` with `spec`; idempotent. A different spec raises ModelConflict."""
        self._register_model(model, spec, tenant=tenant)
        return spec

    def get_spec(self, model: str, *, tenant: str | None = None) -> ModelSpec:
        return self._model(model, tenant).spec

    def drop_model(self, model: str, *, tenant: str | None = None) -> int:
        """Forget the model and drop its pages (prefix and chunk pages) from every tier."""
        with self._lock:
            entry = self._registry.remove(check_model_name(model), tenant)
            dropped = 0
            for root in [r for r in self._index.roots.values() if r.namespace == entry.namespace]:
                for child in list(root.children.values()):
                    if not self._state.pinned_below(child):
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

    def catch_up(self) -> None:
        """Do the learning `learn_later` held back. (The sidecar's loop, which must not wait for
        the lock, catches up through its adapter: api/server/loop_store.py.)"""
        with self._lock:
            self._placement.catch_up()

    def _model(self, model: str, tenant: str | None) -> Model:
        # No lock: a registry read is one dict lookup, and registrations are only ever replaced whole.
        # A registered name passed its check when it was registered; only a miss is checked here.
        entry = self._registry.find(model, tenant) if model.__class__ is str else None
        return entry if entry is not None else self._registry.get(check_model_name(model), tenant)

    # -- lookup ----------------------------------------------------------------------------
    def lookup(self, model: str, tokens: Sequence[int], *, tenant: str | None = None,
               salt: str | None = None) -> LookupResult:
        """How many leading tokens the store holds, and which tier would serve them.

        `salt` (every data call takes one): pages stored under a salt are found only under the
        same salt, within the same tenant (kvstore/keys.py `salt_root`); None is no salt."""
        entry = self._model(model, tenant)
        root_key = _root(entry, salt)
        tb = token_bytes(tokens, max_tokens=MAX_TOKENS)
        probe_shared(self._state, root_key, entry.namespace, entry.spec, tb)
        state = self._state
        with self._lock:
            state.drain_lost_copies()
            state.parts.expire()  # pages whose other parts never came: their memory goes back
            match = self._index.match(root_key, tb, entry.spec.page_size)
            tiers: dict[str, int] = {}
            done = 0
            for node in match.path:
                used = min(node.num_tokens, match.matched_tokens - done)
                tier = self._tiers.source_tier(node)
                if not self._tiers.tiers[tier].available:
                    break  # Redis is unreachable: a fetch could not serve these pages now
                tiers[tier] = tiers.get(tier, 0) + used
                done += used
            state.counters["lookups"] += 1
            state.counters["lookup_hit_tokens"] += done
            return LookupResult(done, tiers)

    # -- fetch -----------------------------------------------------------------------------
    def fetch(self, model: str, tokens: Sequence[int], *, start: int = 0, tenant: str | None = None,
              salt: str | None = None, device: str = "cpu", into: torch.Tensor | None = None,
              heads: tuple[int, int] | None = None, layers: tuple[int, int] | None = None) -> FetchResult:
        """KV of the longest cached prefix: `kv` covers tokens[start:matched_tokens].

        `into`: a flat uint8 CPU tensor the answer is written into (then `kv` views its first
        bytes) when it is large enough; a fresh tensor otherwise. The sidecar passes a region of
        a client's shared memory here, an engine its own staging buffer.

        `heads` / `layers` (start, stop): only those KV heads / layers, (l, 2, T, h, D), copied
        from the pages as they lie (a tensor-parallel rank's heads; kvstore/page_slice.py)."""
        return self._plan_fetch(model, tokens, start=start, tenant=tenant, salt=salt, device=device, into=into,
                                heads=heads, layers=layers).run()

    def fetch_pinned(self, model: str, tokens: Sequence[int], *, start: int = 0, tenant: str | None = None,
                     salt: str | None = None, into: torch.Tensor | None = None) -> PinnedFetch:
        """The same fetch, its pages left where they lie and pinned: `runs` views them in the CPU
        tier's buffer when all of them are there (else None, and `fetch()` copies them into an
        answer, written into `into` as with `fetch`). For an engine that copies KV into its own
        layout anyway; `release()` it (or use it as a context manager) once the copy is done."""
        return PinnedFetch(self._plan_fetch(model, tokens, start=start, tenant=tenant, salt=salt, into=into))

    def _fetch(self, root_key: bytes, namespace: bytes, spec: ModelSpec, tb: bytes, start: int, dev: torch.device,
               count: bool = True, into: torch.Tensor | None = None) -> FetchResult:
        probe_shared(self._state, root_key, namespace, spec, tb)
        return plan_fetch(self._state, root_key, spec, tb, start, dev, count=count, into=into).run()

    def _fetch_head(self, namespace: bytes) -> Any:
        """store_pages' read of the pages before `start`, in `namespace`'s trees."""
        return lambda root_key, spec, tb, start, dev, count: self._fetch(root_key, namespace, spec, tb, start, dev,
                                                                         count)

    # -- store -----------------------------------------------------------------------------
    def store(self, model: str, tokens: Sequence[int], kv: Any, *, start: int = 0,
              tenant: str | None = None, salt: str | None = None, heads: tuple[int, int] | None = None,
              layers: tuple[int, int] | None = None) -> StoreResult:
        """Store KV for tokens[start:] (the store must already hold tokens[:start]).

        `heads` / `layers` (start, stop): `kv` holds only those KV heads / layers, a part of each
        page (a tensor-parallel rank's heads, a pipeline stage's layers). A page is seen by no
        reader until every part of it is stored (kvstore/page_parts.py); `stored_tokens` then
        counts the pages stored or holding this part. A part overlapping a different part of
        the same page raises PartConflict; a part of a page already stored is a no-op."""
        entry = self._model(model, tenant)
        root_key = _root(entry, salt)
        tb = token_bytes(tokens, max_tokens=MAX_TOKENS)
        n_tokens = len(tb) // TOKEN_BYTES
        start = check_start(start, n_tokens)
        part = PageSlice.of(entry.spec, layers=layers, heads=heads)
        kv = check_kv(kv, entry.spec, n_tokens - start, part)
        fetch_head = self._fetch_head(entry.namespace)
        if not part.whole:
            return store_part(self._state, fetch_head, root_key, entry.namespace, entry.spec, tb, kv, start, part)
        return store_pages(self._state, fetch_head, root_key, entry.namespace, entry.spec, tb, kv, start)

    def store_chunk(self, model: str, tokens: Sequence[int], kv: Any, *, tenant: str | None = None,
                    salt: str | None = None) -> StoreResult:
        """Store a chunk's KV computed standalone at positions 0..n-1 (CacheBlend), under its
        position-independent chunk key: the chunk is a prefix tree of its own."""
        entry = self._model(model, tenant)
        root_key = _root(entry, salt)
        tb = token_bytes(tokens, max_tokens=MAX_TOKENS)
        kv = check_kv(kv, entry.spec, len(tb) // TOKEN_BYTES)
        return store_pages(self._state, self._fetch_head(entry.namespace), chunk_key(root_key, tb), entry.namespace,
                           entry.spec, tb, kv, 0)

    def blend(self, model: str, chunks: Sequence[Sequence[int]], *, start_pos: int = 0,
              tenant: str | None = None, salt: str | None = None, device: str = "cpu") -> BlendResult:
        """The chunks' stored KV laid end to end from position `start_pos`, K re-rotated to those
        positions (CacheBlend). A chunk hits only if the store holds all of it; a missed chunk's
        KV is zeros, for the caller to compute (standalone) and `store_chunk`."""
        entry = self._model(model, tenant)
        root_key = _root(entry, salt)
        check_rerotatable(entry.spec)  # before any work: never hand out KV at wrong positions
        tbs = check_chunks(chunks, max_tokens=MAX_TOKENS)
        start_pos = check_start_pos(start_pos)
        dev = check_device(device)
        namespace = entry.namespace
        return blend_chunks(lambda key, spec, tb, dev: self._fetch(key, namespace, spec, tb, 0, dev), self.config,
                            root_key, entry.spec, tbs, start_pos, dev)

    # -- audited reuse (kvstore/reuse_audit.py, kvstore/store_audit.py) ------------------------
    def report_audit(self, model: str, tokens: Sequence[int], *, passed: bool, tier: str | None = None,
                     layer: int | None = None, tenant: str | None = None, salt: str | None = None,
                     chunk: bool = False) -> AuditReport:
        """An engine's audit of the KV it reused for `tokens`' cached prefix, served by `tier`:
        counted per model and tier; a failure (first failing `layer`, if known) drops the matched
        path's pages from every tier and logs one error. `chunk`: `tokens` are a CacheBlend chunk,
        stored with `store_chunk`, and its own tree is the path. `tier` None: the tier holding the
        audited page now (a blend answer does not say which tier served a chunk)."""
        entry = self._model(model, tenant)
        tb = token_bytes(tokens, max_tokens=MAX_TOKENS)
        root_key = _root(entry, salt)
        if check_chunk_flag(chunk):
            root_key = chunk_key(root_key, tb)
        return record_audit(self._state, model, tenant, root_key, entry.spec.page_size, tb,
                            passed=check_passed(passed), tier=check_tier_name(tier), layer=check_layer(layer),
                            chunk=chunk)

    # -- what the sidecar's adapter calls (api/server/loop_store.py): not the embedder's surface -----
    def _register_model(self, model: str, spec: ModelSpec, *, tenant: str | None = None) -> bool:
        """register_model, True when this call created the registration (HTTP 201)."""
        check_model_name(model)
        if not isinstance(spec, ModelSpec):
            raise InvalidModelSpec(f"spec: expected a ModelSpec, got {type(spec).__name__}", field="spec")
        with self._lock:
            return self._registry.register(model, spec, tenant)[1]

    def _plan_fetch(self, model: str, tokens: Sequence[int], *, start: int = 0, tenant: str | None = None,
                    salt: str | None = None, device: str = "cpu", into: torch.Tensor | None = None,
                    heads: tuple[int, int] | None = None, layers: tuple[int, int] | None = None) -> FetchPlan:
        """What `fetch` would read, matched and pinned (after a shared-tier probe, if there is
        one: I/O); `fetch` is `_plan_fetch(...).run()`. The sidecar plans on its event loop and
        runs a plan that needs I/O on a pool thread, so the prompt is matched once."""
        entry = self._model(model, tenant)
        root_key = _root(entry, salt)
        tb = token_bytes(tokens, max_tokens=MAX_TOKENS)
        start = check_start(start, len(tb) // TOKEN_BYTES)
        dev = _device(device)
        part = WHOLE if heads is None and layers is None else PageSlice.of(entry.spec, layers=layers, heads=heads)
        probe_shared(self._state, root_key, entry.namespace, entry.spec, tb)  # returns at once without a shared tier
        return plan_fetch(self._state, root_key, entry.spec, tb, start, dev, into=check_into(into, dev), part=part)

    # -- stats -----------------------------------------------------------------------------
    def stats(self) -> dict[str, Any]:
        """Per tier: pages, bytes, capacity, hits, misses, evictions; plus request counters."""
        return store_stats(self._state)


def _root(entry: Model, salt: str | None) -> bytes:
    """Where `salt`'s pages of the model hang: its namespace, or its salt's root in it."""
    return entry.namespace if salt is None else salt_root(entry.namespace, check_salt(salt))


def _device(device: str) -> torch.device:
    return CPU if device == "cpu" else check_device(device)  # torch.device() costs more than a fetch's lookup
