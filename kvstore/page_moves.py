"""The store's page moves that carry bytes: placement makes room, then the tier stack copies.

    reserve            a new page's room in the top tier that has it (store path, page_writes.py)
    promote            a page a lower tier served, copied into the top tier (fetch path, fetch_plan.py)
    write_through      a new page also written to the persistent tier (durability "write-through")
    save_memory_pages  pages held only in memory, copied to the persistent tier at close

Each one asks `Placement` for room (`make_room`: eviction and demotion, by the tiers' policies
and tenant quotas), has the `TierStack` allocate a slot and copy the bytes, and then tells
placement where the page now is (`add`). The tier stack never calls placement: where a slot tier
has no slot although placement counts the bytes free (its free ranges cut for other page
sizes), it raises TierFull and placement evicts one more page before it is asked again
(`Placement.evicting_while_full`). So placement holds the tier stack (its mover), and nothing
holds placement but the store.

All under the store's lock.
"""
from __future__ import annotations

import numpy as np
import torch

from kvstore.config import ModelSpec
from kvstore.index import Node, PageIndex
from kvstore.placement import Placement
from kvstore.tier_stack import TierStack
from kvstore.tiers.base import Slot, WriteTicket

# (tier, bytes, its slot; None in a record tier), or (None, 0, None): no tier has room.
Room = tuple[str | None, int, Slot | None]


def reserve(placement: Placement, tiers: TierStack, spec: ModelSpec, key: bytes, n: int,
            namespace: bytes | None = None) -> Room:
    """Room for new page `key` of `n` tokens of `namespace` (its tenant's quota holds) in the
    top tier that has it: a slot in a slot tier, bytes counted in a record tier."""
    for tier in placement.order:
        nbytes = tiers.size_for(spec, n, tier)
        if not placement.make_room(tier, nbytes, namespace):
            continue
        if tier not in tiers.slot_tiers:
            return tier, nbytes, None
        slot = placement.evicting_while_full(tier, tiers.allocate, tier, key, nbytes)
        if slot is not None:
            return tier, nbytes, slot
    return None, 0, None


def promote(placement: Placement, tiers: TierStack, spec: ModelSpec, node: Node,
            kv: torch.Tensor | np.ndarray) -> None:
    """Copy a page a lower tier served into the top tier. `kv`: its KV (L, 2, n, H, D), a tensor
    or a numpy view of the fetch answer (`TierStack.fill_slot`)."""
    top = tiers.top
    if top in node.tiers or not tiers.keeps_slots(top) or not node.ready:
        return
    nbytes = tiers.size_in(node, top)
    if not placement.make_room(top, nbytes, node.namespace):
        return
    slot = placement.evicting_while_full(top, tiers.allocate, top, node.key, nbytes)
    if slot is None:
        return
    tiers.fill_slot(spec, node, top, slot, kv)
    placement.add(node, top, nbytes)
    placement.usage[top].promotions += 1


def write_through(placement: Placement, tiers: TierStack, spec: ModelSpec, node: Node,
                  kv: torch.Tensor) -> WriteTicket | None:
    """Also write a new page to the persistent tier (a record tier): its write's ticket, None
    when there is no such tier, the page is there already, or it has no room."""
    tier = tiers.persistent
    if tier is None or tier in node.tiers:
        return None
    nbytes = tiers.size_in(node, tier)
    if not placement.make_room(tier, nbytes):
        return None
    ticket = tiers.put_page(spec, node, tier, kv=kv)
    placement.add(node, tier, nbytes)
    return ticket


def save_memory_pages(placement: Placement, tiers: TierStack, index: PageIndex) -> int:
    """Copy pages held only in memory tiers down to the persistent tier, parents first, while
    room lasts (nothing already there is evicted for them) -> the pages saved."""
    tier = tiers.persistent
    if tier is None:
        return 0
    saved = 0
    for node in sorted(index.nodes.values(), key=lambda n: n.depth):
        if tier in node.tiers or not node.ready:
            continue
        if node.parent is not None and not node.parent.is_root and tier not in node.parent.tiers:
            continue  # its parent did not make it: the page could not be matched after restart
        nbytes = tiers.size_in(node, tier)
        if not placement.fits(tier, nbytes):
            continue  # closing must not evict older disk pages for newer memory ones
        if tiers.copy_down(node, tiers.source_tier(node), tier):
            placement.add(node, tier, nbytes)
            saved += 1
    return saved
