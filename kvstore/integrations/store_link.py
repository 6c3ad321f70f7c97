"""The connector's one way to the store: lookup, fetch and store for a request's salt, never raising.

An engine must produce the same tokens whether or not the store answers, so every failure here
(the sidecar down or slow, a spec conflict, an evicted or corrupt page) becomes a miss: lookup
answers 0, fetch answers fewer tokens, store answers None. After a failure the store is left
alone for `retry_after_s` (each later call would otherwise pay the same timeout), and the
warning is logged at most once every `WARN_EVERY_S`.

A link talks either to a `KVStore` of this process or to a sidecar's URL. One `KVStore` per
`StoreConfig` is shared by every user in a process (`shared_store`): vLLM makes a scheduler-side
and a worker-side connector, both sides must see the same pages, and one LMDB environment
cannot be opened twice by one process. It is closed (memory pages written to disk) when its
last user releases it, or at exit.

A request's `cache_salt` is passed to the store as its salt: its pages are found under that salt
only, inside the tenant the link talks as (kvstore/keys.py `salt_root`). A sidecar takes the
tenant from the bearer token, so there is one `KVStoreClient` per token; the token is the
config's `token`, or the one `tokens` names for the salt.
"""
from __future__ import annotations

import atexit
import logging
import threading
import time
from typing import Any, Sequence

from kvstore import KVStore, KVStoreClient, KVStoreError, ModelSpec, StoreConfig
from kvstore.integrations.connector_config import ConnectorConfig
from kvstore.page_slice import PageSlice
from kvstore.pinned_fetch import PinnedFetch
from kvstore.reuse_audit import tier_at
from kvstore.validation import check_salt

log = logging.getLogger("kvstore.vllm")
WARN_EVERY_S = 10.0

_SHARED_LOCK = threading.Lock()
_SHARED: dict[StoreConfig, list[Any]] = {}  # config -> [KVStore, users]


def shared_store(config: StoreConfig) -> KVStore:
    """This process's `KVStore` for `config`, opened on first use; pair with `release_store`."""
    with _SHARED_LOCK:
        entry = _SHARED.get(config)
        if entry is None:
            entry = _SHARED[config] = [KVStore(config), 0]
        entry[1] += 1
        return entry[0]


def release_store(config: StoreConfig) -> None:
    with _SHARED_LOCK:
        entry = _SHARED.get(config)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] > 0:
            return
        del _SHARED[config]
    entry[0].close()


@atexit.register
def _close_shared_stores() -> None:
    # An engine that exits without shutting down still leaves its memory pages on disk.
    with _SHARED_LOCK:
        entries = list(_SHARED.values())
        _SHARED.clear()
    for store, _ in entries:
        store.close()


class RateLimitedWarning:
    """`warn(msg)` logs at most once every `every_s`; the ones in between are counted."""

    def __init__(self, every_s: float = WARN_EVERY_S):
        self.every_s = every_s
        self._last = -float("inf")
        self.suppressed = 0

    def warn(self, message: str, *args: Any) -> None:
        now = time.monotonic()
        if now - self._last < self.every_s:
            self.suppressed += 1
            return
        self._last = now
        if self.suppressed:
            message += " (%d similar warnings in the last %.0f s)"
            args = (*args, self.suppressed, self.every_s)
            self.suppressed = 0
        log.warning(message, *args)


class StoreLink:
    """lookup / fetch / store of one model's pages on behalf of requests with a given salt."""

    def __init__(self, config: ConnectorConfig, model: str, spec: ModelSpec, *, url: str | None = None,
                 heads: tuple[int, int] | None = None):
        """With `url` (or `config.url`): that sidecar; else this process's store for `config.store`.
        `heads`: the KV heads this link fetches and stores, a part of every page (a tensor-parallel
        rank's, kvstore/page_parts.py); None: all of them."""
        self.config, self.model, self.spec = config, model, spec
        self.heads = heads
        self.part = PageSlice.of(spec, heads=heads)
        self.url = url or config.url
        if self.url is None:
            assert config.store is not None  # the connector's config holds one of url and store
            self._store: KVStore | None = shared_store(config.store)
        else:
            self._store = None
        self._clients: dict[str, KVStoreClient] = {}  # bearer token ("" for none) -> client
        self._registered: set[int] = set()  # backends the model is registered with (by id)
        self._down_until = 0.0
        self._lock = threading.Lock()
        self.warning = RateLimitedWarning()
        self._closed = False

    @property
    def in_process_store(self) -> KVStore | None:
        """This process's store, when the link uses one (None: a sidecar)."""
        return self._store

    # -- which backend serves a salt ----------------------------------------------------------
    def _backend(self, salt: str | None) -> Any:
        """The store, or the sidecar client whose bearer token requests with `salt` use."""
        if self._store is not None:
            return self._store
        token = self.config.token_for(salt)
        key = token or ""
        with self._lock:
            client = self._clients.get(key)
            if client is None:
                client = self._clients[key] = KVStoreClient(self.url, token=token, timeout_s=self.config.timeout_s,
                                                            shared_memory_bytes=self.config.shared_memory_bytes)
        return client

    def usable(self, salt: str | None) -> bool:
        """Whether requests with `salt` can use the store: a salt the store would refuse (over
        MAX_SALT_BYTES) is computed by the engine alone, and does not count as a store failure."""
        try:
            check_salt(salt)
        except KVStoreError as exc:
            self.warning.warn("kvstore: a request's cache_salt is not used with the store (%s); it is computed", exc)
            return False
        return True

    def _call(self, what: str, salt: str | None, fn: Any) -> Any:
        """`fn(backend)` after registering the model; None on any failure (then the store is left
        alone for retry_after_s)."""
        if self._closed or time.monotonic() < self._down_until:
            return None
        backend = self._backend(salt)
        key = id(backend)
        try:
            if key not in self._registered:
                backend.register_model(self.model, self.spec)
                self._registered.add(key)
            try:
                return fn(backend)
            except KVStoreError as exc:
                if exc.code != "model_not_found":
                    raise
                # A sidecar restarted without its disk tier, or the model was dropped: register again.
                backend.register_model(self.model, self.spec)
                return fn(backend)
        except Exception as exc:  # every failure is a miss: the engine recomputes
            self._down_until = time.monotonic() + self.config.retry_after_s
            self._registered.discard(key)
            self.warning.warn("kvstore %s failed (%s: %s); recomputing, and leaving the store alone for %.0f s",
                              what, type(exc).__name__, exc, self.config.retry_after_s)
            return None

    # -- the three calls ----------------------------------------------------------------------
    def lookup(self, tokens: Sequence[int], salt: str | None) -> int:
        """Leading tokens of `tokens` the store holds now (0 on failure)."""
        result = self._call("lookup", salt, lambda b: b.lookup(self.model, tokens, salt=salt))
        return 0 if result is None else int(result.matched_tokens)

    def fetch(self, tokens: Sequence[int], start: int, salt: str | None,
              into: Any = None) -> tuple[int, Any]:
        """(matched tokens, kv (L, 2, matched - start, H, D)) of `tokens`; (0, None) on failure.
        Anything but KV of the spec's shape and dtype is a failure: it would be wrong tokens.
        `into` (a flat uint8 CPU tensor): where an in-process store writes the answer, or a
        sidecar's answer over TCP is received, when it fits (kv then views it); through shared
        memory the answer lands in the client's arena instead."""
        result = self._call("fetch", salt, lambda b: b.fetch(self.model, tokens, start=start, salt=salt, into=into,
                                                             heads=self.heads))
        return self._checked(result, tokens, start)

    def fetch_in_place(self, tokens: Sequence[int], start: int, salt: str | None,
                       into: Any = None) -> tuple[int, Any, PinnedFetch | None]:
        """An in-process store's fetch with its pages left where they lie when they all are in
        its CPU tier: (matched, None, pinned), the caller reading `pinned.runs` and then
        releasing it. Otherwise `fetch`'s answer: (matched, kv, None); (0, None, None) on failure."""
        assert self._store is not None and self.heads is None, \
            "fetch_in_place: only an in-process store's whole pages are read in place"

        def read(store: KVStore) -> Any:
            pinned = store.fetch_pinned(self.model, tokens, start=start, salt=salt, into=into)
            return pinned if pinned.runs is not None else pinned.fetch()

        result = self._call("fetch", salt, read)
        if isinstance(result, PinnedFetch):
            assert result.runs is not None  # read() keeps a pinned fetch only with its runs
            page = (self.spec.num_layers, 2, self.spec.page_size, self.spec.num_kv_heads, self.spec.head_dim)
            wrong = [run.pages for run in result.runs if tuple(run.pages.shape[1:]) != page
                     or str(run.pages.dtype).removeprefix("torch.") != self.spec.dtype]
            if wrong or result.in_place_tokens <= start:
                result.release()
                if wrong:
                    self.warning.warn("kvstore fetch answered pages %s %s, expected %s %s; recomputing",
                                      tuple(wrong[0].shape[1:]), wrong[0].dtype, page, self.spec.dtype)
                return 0, None, None
            return min(result.in_place_tokens, len(tokens)), None, result
        return (*self._checked(result, tokens, start), None)

    def _checked(self, result: Any, tokens: Sequence[int], start: int) -> tuple[int, Any]:
        if result is None or result.matched_tokens <= start or result.kv is None:
            return 0, None
        matched = min(int(result.matched_tokens), len(tokens))
        kv = result.kv
        expected = self.part.kv_shape(self.spec, int(result.matched_tokens) - start)
        if tuple(kv.shape) != expected or str(kv.dtype).removeprefix("torch.") != self.spec.dtype:
            self.warning.warn("kvstore fetch answered kv %s %s, expected %s %s; recomputing",
                              tuple(kv.shape), kv.dtype, expected, self.spec.dtype)
            return 0, None
        return matched, kv

    def store(self, tokens: Sequence[int], kv: Any, start: int, salt: str | None) -> int | None:
        """Store KV of tokens[start:] (this link's heads); the tokens the store now holds of
        `tokens` (for a part: whole, or holding this part), None on failure."""
        result = self._call("store", salt, lambda b: b.store(self.model, tokens, kv, start=start, salt=salt,
                                                             heads=self.heads))
        return None if result is None else int(result.stored_tokens)

    # -- audited reuse (vllm_audit.py) ----------------------------------------------------------
    def audit_source(self, tokens: Sequence[int], start: int, salt: str | None) -> tuple[str, Any] | None:
        """(the tier serving tokens[start:], their stored KV) for an audit; None if the store no
        longer holds them all (or fails)."""
        found = self._call("lookup", salt, lambda b: b.lookup(self.model, tokens, salt=salt))
        if found is None or found.matched_tokens < len(tokens):
            return None
        matched, kv = self.fetch(tokens, start, salt)
        if matched < len(tokens):
            return None
        return tier_at(found.tiers, start), kv[:, :, :len(tokens) - start]

    def report_audit(self, tokens: Sequence[int], salt: str | None, *, passed: bool, tier: str,
                     layer: int | None) -> None:
        self._call("report_audit", salt, lambda b: b.report_audit(self.model, tokens, passed=passed, tier=tier,
                                                                  layer=layer, salt=salt))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for client in self._clients.values():
            client.close()
        if self._store is not None and self.config.store is not None:  # (the store came from it)
            self._store = None
            release_store(self.config.store)
