"""What every store operation shares (the page tree, placement, the tiers, the models, the
logical clock and the request counters), and the one lock that guards it.

Invariants:
- the tree (`index`), `placement` (and through it each tier's bookkeeping: `Node.tiers`, slots
  allocated and released), `clock` and `counters` change only under `lock`;
- page bytes are copied outside the lock, on pinned pages only: a pinned page is never evicted,
  so its slot or record cannot be reused under the copy;
- a page is matchable only once `ready`: its bytes are all written before it is marked so;
- a store acknowledges only pages that are `ready`: one that meets a page another store is still
  writing waits on `published` until that store publishes it or gives it up (page_writes.py).

`KVStore` (kvstore/store.py) is the façade over this; the operations live in their own
modules (fetch_plan.py, page_writes.py, shared_probe.py, blend.py, store_stats.py).
"""
from __future__ import annotations

import threading

import torch

from kvstore.gpu.dtypes import KV_DTYPES
from kvstore.config import ModelSpec, StoreConfig
from kvstore.index import Node, PageIndex
from kvstore.page_slice import WHOLE, PageSlice
from kvstore.partial_pages import PageParts
from kvstore.placement import Placement
from kvstore.registry import ModelRegistry
from kvstore.store_audit import AuditCounts
from kvstore.tier_stack import TierStack


class StoreState:
    def __init__(self, config: StoreConfig):
        self.config = config
        # Re-entrant: a caller that holds it (api/server/loop_store.py `unless_busy`) may call any store method.
        self.lock = threading.RLock()
        # Notified whenever a store publishes its pages or gives them up: a store that met a page
        # another one was writing waits here for it (kvstore/page_writes.py).
        self.published = threading.Condition(self.lock)
        self.waiting = 0  # stores waiting on `published` (publishing notifies only if any)
        # True while a caller that must never wait holds the lock (api/server/loop_store.py `unless_busy`): a store
        # that would wait for another's page raises StoreBusy instead.
        self.must_not_wait = False
        self.index = PageIndex()
        self.registry = ModelRegistry(config.data_dir if config.disk_bytes else None)
        self.tiers = tiers = TierStack(config, self.registry)
        self.placement = Placement(self.index, tiers.capacities, config.policy, mover=tiers,
                                   size_in=tiers.size_in, raw_size_in=tiers.raw_size_in,
                                   tenant_of=self.registry.tenants_by_namespace.get)
        self.parts = PageParts(config.part_timeout_s, config.part_bytes)  # pages being written in parts
        self.clock = 0  # logical time of the last request that touched pages (policies' recency)
        self.counters = {"lookups": 0, "fetches": 0, "stores": 0, "lookup_hit_tokens": 0,
                         "fetched_tokens": 0, "stored_pages": 0, "requested_tokens": 0}
        self.audits = AuditCounts()  # engines' audits of reused KV, per model and tier (store_audit.py)

    def tick(self) -> int:
        """Advance the clock for a request that touches pages (under the lock)."""
        self.clock += 1
        return self.clock

    def drain_lost_copies(self) -> None:
        """Forget copies a tier lost on its own (corrupt records, failed writes); under the lock."""
        for name, tier in self.tiers.losing:
            for key in tier.take_failed():
                node = self.index.get(key)
                if node is not None:
                    self.placement.remove_from(node, name)

    def count_misses(self, path: list[Node], missed: bool) -> None:
        """Each tier above the one that served a page counts a miss; a page no tier holds is a
        miss everywhere (tiers are consulted top down)."""
        for node in path:
            for tier in self.placement.order:
                if tier in node.tiers:
                    break
                self.placement.usage[tier].misses += 1
        if missed:
            for tier in self.placement.order:
                self.placement.usage[tier].misses += 1

    def pinned_below(self, node: Node) -> bool:
        return any(page.pins for page in self.index.subtree(node))


def empty_kv(spec: ModelSpec, dev: torch.device, part: PageSlice = WHOLE) -> torch.Tensor:
    return torch.empty(part.kv_shape(spec, 0), dtype=KV_DTYPES[spec.dtype], device=dev)  # (L, 2, 0, H, D)
