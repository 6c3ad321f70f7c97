"""The store's side of audited reuse (kvstore/reuse_audit.py): count each audit an engine
reports, and when one failed, drop the matched path's pages from every tier.

A failed audit cannot say which page of the path is wrong (wrong KV early in the prefix shows
up in the audited page through attention), so the whole matched path goes: from its first page
on, with everything stored below it, since a page cannot outlive its parent in the tree. Pages
another request holds pinned at that moment cannot be dropped; the drop starts at the first page
of the path with nothing pinned below it, and the pages above stay (counted in the answer).

A CacheBlend chunk's audit (`chunk=True`) names the chunk's tokens: its path is the chunk's own
tree (keys.chunk_key), dropped the same way. A blend answer does not say which tier served a
chunk, so the engine reports no tier and the store names the one holding the audited page, the
path's last full page, now (the top tier when nothing of the path is held any more).

Counts are per model and per tier that served the audited page: `kvstore_audit_passes_total`
and `kvstore_audit_failures_total` on /metrics, `audits` in stats.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvstore.errors import InvalidRequest
from kvstore.results import AuditReport

if TYPE_CHECKING:
    from kvstore.index import Node
    from kvstore.store_state import StoreState

log = logging.getLogger("kvstore.audit")


@dataclass
class AuditCounts:
    """(model, tier) -> [passes, failures]; changed under the store's lock."""

    by_model_tier: dict[tuple[str, str], list[int]] = field(default_factory=dict)

    def add(self, model: str, tier: str, passed: bool) -> None:
        counts = self.by_model_tier.setdefault((model, tier), [0, 0])
        counts[0 if passed else 1] += 1

    def as_stats(self) -> dict[str, dict[str, dict[str, int]]]:
        """{model: {tier: {"passes": n, "failures": n}}}, the shape stats and /metrics read."""
        out: dict[str, dict[str, dict[str, int]]] = {}
        for (model, tier), (passes, failures) in sorted(self.by_model_tier.items()):
            out.setdefault(model, {})[tier] = {"passes": passes, "failures": failures}
        return out


def record_audit(state: StoreState, model: str, tenant: str | None, root_key: bytes, page_size: int, tb: bytes, *,
                 passed: bool, tier: str | None, layer: int | None = None, chunk: bool = False) -> AuditReport:
    """Count one audit of the reuse of `tb`'s matched prefix (under `root_key`: a chunk's own
    root for a chunk); on a failure, drop its path and log it once (the model, the tenant, the
    tier that served the page, the first failing layer). `tier` None: the store names it."""
    report, tier = _record(state, model, root_key, page_size, tb, passed=passed, tier=tier)
    if not passed:
        log.error("kvstore audit failed: model %s, tenant %s, tier %s, first failing layer %s: the reused KV is not "
                  "what the engine computes; dropped %d pages of the matched %s (%d tokens)%s", model,
                  tenant or "default", tier, "?" if layer is None else layer, report.dropped_pages,
                  "chunk" if chunk else "path", len(tb) // 4,
                  f", {report.kept_pages} pinned pages kept" if report.kept_pages else "")
    return report


def _record(state: StoreState, model: str, root_key: bytes, page_size: int, tb: bytes, *, passed: bool,
            tier: str | None) -> tuple[AuditReport, str]:
    with state.lock:
        if tier is not None and tier not in state.placement.order:  # a label on /metrics: only the store's tiers
            raise InvalidRequest(f"tier: expected one of {', '.join(state.placement.order)}, got {tier!r}",
                                 field="tier")
        state.drain_lost_copies()
        path = state.index.match(root_key, tb, page_size).path
        tier = tier or _holding_tier(state, path)
        state.audits.add(model, tier, passed)
        if passed:
            return AuditReport(0, 0), tier
        first = _first_droppable(state, path)
        if first is None:
            return AuditReport(0, len(path)), tier
        kept = path.index(first)
        return AuditReport(state.placement.drop(first), kept), tier


def _holding_tier(state: StoreState, path: list[Node]) -> str:
    """The tier holding the path's last full page (the audited one), or the top tier."""
    full = [node for node in path if not node.tail]
    return state.tiers.source_tier(full[-1]) if full else state.placement.order[0]


def _first_droppable(state: StoreState, path: list[Node]) -> Node | None:
    for node in path:
        if not state.pinned_below(node):
            return node
    return None


def check_passed(passed: object) -> bool:
    if not isinstance(passed, bool):
        raise InvalidRequest(f"passed: expected true or false, got {passed!r}", field="passed")
    return passed


def check_tier_name(tier: object) -> str | None:
    if tier is not None and not isinstance(tier, str):
        raise InvalidRequest(f"tier: expected a tier name or none, got {tier!r}", field="tier")
    return tier


def check_chunk_flag(chunk: object) -> bool:
    if not isinstance(chunk, bool):
        raise InvalidRequest(f"chunk: expected true or false, got {chunk!r}", field="chunk")
    return chunk


def check_layer(layer: object) -> int | None:
    if layer is not None and (isinstance(layer, bool) or not isinstance(layer, int) or layer < 0):
        raise InvalidRequest(f"layer: expected a layer index >= 0 or none, got {layer!r}", field="layer")
    return layer
