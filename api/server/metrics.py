"""Prometheus metrics of one app, on its own registry (several apps in one process, as in
tests, never collide): requests by route and status, latency by route, and the store's
per-tier counters read from `store.stats()` at scrape time.

Routes are labelled by their template (`/v1/models/{model}`), never the raw path, so a client
cannot blow up label cardinality; unmatched paths share one label (UNMATCHED). Both servers count
into the same two metrics: the data plane (api/server/fast_path.py) as it writes an answer, aiohttp's
`measure` middleware (api/admin/middleware.py) for the admin routes.
"""
from __future__ import annotations

from typing import Any, Callable, Iterator

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

# Store stats that only grow: exported as counters; everything else per tier is a gauge.
MONOTONIC = frozenset({"hits", "misses", "evictions", "corrupt_records", "promotions", "demotions", "dropped_pages",
                       "lookups", "fetches", "stores", "requested_tokens", "lookup_hit_tokens"})
UNMATCHED = "unmatched"  # the route label of a path no route matches (and of a wrong method)
LATENCY_BUCKETS_S = (0.0005, 0.001, 0.002, 0.005, 0.01, 0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0)


class StoreCollector(Collector):
    """Turns `store.stats()` into metric families when Prometheus scrapes."""

    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self._stats = stats

    def collect(self) -> Iterator[Metric]:
        stats = self._stats()
        per_tier: dict[str, dict[str, float]] = {}
        for tier, values in (stats.get("tiers") or {}).items():
            for name, value in values.items():
                if _is_number(value):
                    per_tier.setdefault(name, {})[tier] = float(value)
        for name, by_tier in sorted(per_tier.items()):
            family = _family(f"kvstore_tier_{name}", f"store.stats() tiers.*.{name}", name, ["tier"])
            for tier, value in by_tier.items():
                family.add_metric([tier], value)
            yield family
        yield from _audit_families(stats.get("audits") or {})
        for name, value in sorted(stats.items()):
            if _is_number(value):
                family = _family(f"kvstore_{name}", f"store.stats() {name}", name, [])
                family.add_metric([], float(value))
                yield family


def _audit_families(audits: dict[str, dict[str, dict[str, int]]]) -> Iterator[Metric]:
    """Engines' audits of reused KV (kvstore/store_audit.py): passes and failures per model and
    the tier that served the audited page; failures / (passes + failures) is the failure rate."""
    for outcome, doc in (("passes", "audits of reused KV that matched what the engine computed"),
                         ("failures", "audits of reused KV that did not (the matched path was dropped)")):
        family = CounterMetricFamily(f"kvstore_audit_{outcome}", doc, labels=["model", "tier"])
        for model, by_tier in audits.items():
            for tier, counts in by_tier.items():
                family.add_metric([model, tier], float(counts.get(outcome, 0)))
        yield family


def _family(metric: str, doc: str, name: str, labels: list[str]) -> CounterMetricFamily | GaugeMetricFamily:
    if name in MONOTONIC:
        return CounterMetricFamily(metric.removesuffix("_total"), doc, labels=labels)
    return GaugeMetricFamily(metric, doc, labels=labels)


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


class KVEventsCollector(Collector):
    """The KV-event publisher's counters (kvstore/kv_events/publisher.py): events dropped past its
    bound (each drop is followed by a resync), batches and events sent, records queued."""

    def __init__(self, publisher: Any):
        self._publisher = publisher

    def collect(self) -> Iterator[Metric]:
        p = self._publisher
        for name, doc, value in (("dropped", "KV events dropped past the publisher's bound (then resynced)", p.dropped),
                                 ("batches", "KV event batches published", p.published_batches),
                                 ("published", "KV events published", p.published_events)):
            family = CounterMetricFamily(f"kvstore_kv_events_{name}", doc, labels=[])
            family.add_metric([], float(value))
            yield family
        queued = GaugeMetricFamily("kvstore_kv_events_queued", "KV events waiting to be published", labels=[])
        queued.add_metric([], float(p.queued))
        yield queued


class Metrics:
    def __init__(self, stats: Callable[[], dict[str, Any]]):
        self.registry = CollectorRegistry()
        self.requests = Counter("kvstore_http_requests", "HTTP requests by route, method and status",
                                ["route", "method", "status"], registry=self.registry)
        self.latency = Histogram("kvstore_http_request_duration_seconds", "HTTP request latency by route",
                                 ["route", "method"], buckets=LATENCY_BUCKETS_S, registry=self.registry)
        self.registry.register(StoreCollector(stats))

    def watch_kv_events(self, publisher: Any) -> None:
        self.registry.register(KVEventsCollector(publisher))

    def render(self) -> bytes:
        """The text exposition; calls store.stats(), so run it off the event loop."""
        return generate_latest(self.registry)

    content_type = CONTENT_TYPE_LATEST
