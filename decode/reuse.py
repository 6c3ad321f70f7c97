"""The decode loop's side of the store: register, look up, fetch into the paged cache, store back.

Everything here degrades instead of failing: a backend that raises, times out, answers with KV
of the wrong shape or refuses the model spec costs a full prefill and a `BackendWarning`, never
a wrong token. A miss is not an error and warns nothing.

Works with any `KVCacheBackend`: the in-process `KVStore` or the sidecar's `KVStoreClient`.
"""
from __future__ import annotations

import logging
import threading
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence, TypeVar

import torch

from kvstore.decode.model import LlamaModel
from kvstore.decode.paged_cache import BlockTable, PagedKVCache
from kvstore.backend import KVCacheBackend
from kvstore.errors import ModelNotFound
from kvstore.reuse_audit import AuditOutcome, audited_span, compare_page, sampled, tier_at

log = logging.getLogger("kvstore.audit")

T = TypeVar("T")


class BackendWarning(RuntimeWarning):
    """The store could not help this request; it was served by a full prefill instead."""


class BackendTimeout(TimeoutError):
    pass


# Backends this process has already registered models with, so registration is not paid per request.
_REGISTERED: "weakref.WeakKeyDictionary[Any, set[tuple]]" = weakref.WeakKeyDictionary()


def call_with_timeout(fn: Callable[[], T], timeout_s: float | None) -> T:
    """Run `fn`, giving up after `timeout_s` (None = wait forever).

    The call runs on a daemon thread so a hung backend cannot hang the request; if it finishes
    late its result is dropped (a late store is harmless, a late fetch is ignored).
    """
    if timeout_s is None:
        return fn()
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as exc:  # handed to the caller's thread below
            box["error"] = exc

    worker = threading.Thread(target=run, daemon=True, name="kvstore-backend-call")
    worker.start()
    worker.join(timeout_s)
    if worker.is_alive():
        raise BackendTimeout(f"backend call did not answer within {timeout_s} s")
    if "error" in box:
        raise box["error"]
    return box["value"]


@dataclass(frozen=True)
class PendingAudit:
    """A hit's withheld page (kvstore/reuse_audit.py): positions start..end-1 are prefilled by
    this request, then compared with `stored`, the page the store served for them."""

    start: int
    end: int
    stored: torch.Tensor  # (L, 2, end - start, H, D)
    tier: str  # the tier lookup said serves the page
    query: list[int]  # the tokens whose matched path was reused (a failure drops that path)


@dataclass
class PrefixHit:
    reused_tokens: int = 0  # leading prompt tokens whose KV now sits in the paged cache
    tiers: dict[str, int] = field(default_factory=dict)  # tier -> matched tokens, as lookup reported
    error: str | None = None  # why the backend could not be used, if it could not
    audit: PendingAudit | None = None  # set when this hit is audited: its last full page was withheld


class PrefixReuse:
    """One request's conversation with the store, bound to a model, a backend and a tenant."""

    def __init__(self, model: LlamaModel, backend: KVCacheBackend, *, tenant: str | None = None,
                 timeout_s: float | None = 10.0):
        self.model, self.backend, self.tenant, self.timeout_s = model, backend, tenant, timeout_s

    def _call(self, fn: Callable[[], T]) -> T:
        return call_with_timeout(fn, self.timeout_s)

    def _degrade(self, what: str, exc: BaseException) -> str:
        message = f"kvstore {what} failed ({type(exc).__name__}: {exc}); continuing without it"
        warnings.warn(message, BackendWarning, stacklevel=3)
        return message

    def _registered(self) -> set[tuple]:
        try:
            return _REGISTERED.setdefault(self.backend, set())
        except TypeError:  # not weak-referenceable: register every time
            return set()

    def register(self) -> str | None:
        """Register the model's spec once per backend; returns an error message on failure."""
        key = (self.model.name, self.model.spec, self.tenant)
        done = self._registered()
        if key in done:
            return None
        try:
            self._call(lambda: self.backend.register_model(self.model.name, self.model.spec, tenant=self.tenant))
        except Exception as exc:
            return self._degrade("register_model", exc)
        done.add(key)
        return None

    def _call_registered(self, fn: Callable[[], T]) -> T:
        """`fn` against the backend; if the backend forgot the model (a sidecar restarted without
        its disk tier, the model was dropped), register it again and retry once."""
        try:
            return self._call(fn)
        except ModelNotFound:
            self._registered().discard((self.model.name, self.model.spec, self.tenant))
            self._call(lambda: self.backend.register_model(self.model.name, self.model.spec, tenant=self.tenant))
            self._registered().add((self.model.name, self.model.spec, self.tenant))
            return self._call(fn)

    def load_prefix(self, prompt: Sequence[int], cache: PagedKVCache, table: BlockTable, *,
                    min_reuse_tokens: int = 1, audit_rate: float = 0.0) -> PrefixHit:
        """lookup -> fetch -> scatter into `table`; at most len(prompt) - 1 tokens are reused so the
        last prompt token is always computed and the first token has logits. With probability
        `audit_rate` the hit is audited: its last full page is left out of the scatter and kept
        in `PrefixHit.audit` for `finish_audit` once the caller has prefilled it."""
        error = self.register()
        if error:
            return PrefixHit(error=error)
        query = list(prompt[:-1])
        if len(query) < max(1, min_reuse_tokens):
            return PrefixHit()
        name, tenant = self.model.name, self.tenant
        try:
            found = self._call_registered(lambda: self.backend.lookup(name, query, tenant=tenant))
            if found.matched_tokens < max(1, min_reuse_tokens):
                return PrefixHit(tiers=dict(found.tiers))
            fetched = self._call(lambda: self.backend.fetch(name, query[:found.matched_tokens], tenant=tenant))
            matched = fetched.matched_tokens
            if matched < max(1, min_reuse_tokens):
                return PrefixHit(tiers=dict(found.tiers))  # evicted between lookup and fetch
            kv = self._check_kv(fetched.kv, matched, found.matched_tokens)
        except Exception as exc:
            return PrefixHit(error=self._degrade("lookup/fetch", exc))
        span = audited_span(matched, self.model.spec.page_size, len(prompt)) if sampled(audit_rate) else None
        if span is None:
            cache.scatter(table, kv, start=0)
            return PrefixHit(reused_tokens=matched, tiers=dict(found.tiers))
        start, end = span
        if start:
            cache.scatter(table, kv[:, :, :start], start=0)
        stored = kv[:, :, start:end].clone()  # (L, 2, P, H, D): the answer may be a reused buffer
        audit = PendingAudit(start, end, stored, tier_at(found.tiers, start), query[:matched])
        return PrefixHit(reused_tokens=start, tiers=dict(found.tiers), audit=audit)

    def finish_audit(self, audit: PendingAudit, cache: PagedKVCache, table: BlockTable) -> AuditOutcome:
        """Compare the page this request computed with the one the store served, and tell the
        store: a pass is counted, a failure also drops the matched path in every tier. The
        caller recomputes the request's whole prefix after a failure."""
        computed = cache.gather(table, audit.start, audit.end)  # (L, 2, P, H, D)
        outcome = compare_page(computed, audit.stored, self.model.dtype)
        if not outcome.passed:
            log.warning("kvstore audit: model %s, %s; recomputing this request's prefix", self.model.name,
                        outcome.describe())
        self.report_audit(audit.query, outcome, tier=audit.tier)
        return outcome

    def report_audit(self, tokens: list[int], outcome: AuditOutcome, *, tier: str | None,
                     chunk: bool = False) -> None:
        """Tell the store (it counts, and on a failure logs and drops the path: the chunk's own
        tree for a `chunk`). A backend without report_audit is told nothing; the request still
        acts on the outcome."""
        report = getattr(self.backend, "report_audit", None)
        if report is None:
            return
        failure = outcome.first_failure
        layer = None if failure is None else failure[0]
        extra = {"chunk": True} if chunk else {}  # a prefix's report: what backends without chunk audits take
        try:
            self._call_registered(lambda: report(self.model.name, tokens, passed=outcome.passed, tier=tier,
                                                 layer=layer, tenant=self.tenant, **extra))
        except Exception as exc:
            self._degrade("report_audit", exc)

    def _check_kv(self, kv: Any, matched: int, asked: int) -> torch.Tensor:
        # Trust nothing from across a process boundary: a wrong shape or dtype means a wrong answer.
        if not 0 < matched <= asked:
            raise ValueError(f"fetch matched {matched} tokens of a {asked}-token query")
        kv = torch.as_tensor(kv)
        expected = self.model.spec.kv_shape(matched)
        if tuple(kv.shape) != expected or kv.dtype != self.model.dtype:
            raise ValueError(f"fetched kv is {tuple(kv.shape)} {kv.dtype}, expected {expected} {self.model.dtype}")
        return kv

    def store(self, tokens: Sequence[int], cache: PagedKVCache, table: BlockTable, *, known_tokens: int = 0) -> int:
        """Store the KV of `tokens` (all in `table`); the first `known_tokens` are already in the store,
        so only pages from the one holding token `known_tokens` on are sent. Returns the tokens the
        store now holds of `tokens` (`known_tokens` on failure)."""
        page = self.model.spec.page_size
        start = min(known_tokens, len(tokens)) // page * page  # pages are stored whole: start on a boundary
        if start >= len(tokens):
            return known_tokens
        kv = cache.gather(table, start, len(tokens))  # (L, 2, T - start, H, D)
        seq = list(tokens)
        try:
            result = self._call_registered(
                lambda: self.backend.store(self.model.name, seq, kv, start=start, tenant=self.tenant))
        except Exception as exc:
            self._degrade("store", exc)
            return known_tokens
        # Less than `known_tokens` when the prefix was evicted meanwhile: the next store then starts
        # earlier and sends it again.
        return min(result.stored_tokens, len(tokens))

