"""The store's statistics: per tier (pages, bytes, capacity, hits, misses, evictions, codec and
what it saves), per tenant (its quota and bytes held per memory tier), and the request counters.

Tenants are reported by name only: tokens never reach the stats.
"""
from __future__ import annotations

from typing import Any

from kvstore.store_state import StoreState


def store_stats(state: StoreState) -> dict[str, Any]:
    with state.lock:
        placement = state.placement
        tiers = {}
        for name in placement.order:
            u = placement.usage[name]
            tiers[name] = {"pages": u.pages, "bytes": u.used_bytes, "capacity_bytes": u.capacity_bytes,
                           "hits": u.hits, "misses": u.misses, "evictions": u.evictions,
                           "demotions": u.demotions, "promotions": u.promotions,
                           "codec": state.tiers.codecs[name].name, "saved_bytes": u.saved_bytes}
            extra = state.tiers.tiers[name].stats()  # tier-specific counters (Redis: up, errors, missing pages)
            tiers[name].update({k: v for k, v in extra.items() if k not in tiers[name]})
        tenants: dict[str, dict[str, Any]] = {}
        for tenant, quota in placement.quotas.items():
            tenants[tenant] = {"max_bytes": quota, "bytes": {}}
        for (tier, tenant), nbytes in placement.tenant_bytes.items():
            tenants.setdefault(tenant, {"max_bytes": None, "bytes": {}})["bytes"][tier] = nbytes
        corrupt = sum(tier.corrupt_records for tier in state.tiers.tiers.values())
        parts = state.parts
        parts.expire()
        # Pages written in parts that are still waiting for their other parts (kvstore/page_parts.py).
        waiting = {"pages": len(parts.pages), "bytes": parts.nbytes, "given_up": parts.expired}
        return {"tiers": tiers, "pages": len(state.index), "corrupt_records": corrupt,
                "dropped_pages": placement.dropped_pages, "policy": state.config.policy,
                "models": len(state.registry._models), "tenants": tenants, "partial_pages": waiting,
                "audits": state.audits.as_stats(), **state.counters}
