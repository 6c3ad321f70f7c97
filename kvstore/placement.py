"""Placement: which tier holds which page, byte accounting, eviction and demotion.

This is the one place where pages move between tiers (docs/design.md §4, style rule 4). It decides;
the store's `TierMover` (the tier stack) does the byte copies and never calls back: where a
slot tier has no slot for a page although its bytes fit, the mover raises TierFull and placement
evicts one more page and asks again (`evicting_while_full`). It is payload-free, so the eviction
benchmark replays real traces through exactly this code with a mover that copies nothing. The
store's moves that carry a page's bytes (a new page's room, a promotion, a write-through, saving
memory pages at close) make room here first, then have the tier stack copy: kvstore/page_moves.py.

- `make_room(tier, nbytes)` evicts victims chosen by the tier's policy until `nbytes` fit. A
  victim is demoted (write-back) to the next tier down that can take it; the bottom tier, or a
  tier below which nothing can take it, drops it.
- A page whose last copy is dropped takes its whole subtree with it: a page whose parent is
  gone can never be matched again (index invariant).
- Pinned pages are never chosen (policies skip them).
- Per-tenant quotas (`set_quota`): a tenant with `max_bytes` may hold at most that many bytes in
  each memory tier (gpu and cpu, capped separately: they are the small, contended tiers; disk and
  Redis are not capped). When one of its pages enters a memory tier and it would go over, its own
  pages are evicted first (its own policy instance, kept alongside the tier's, ranks only its
  pages: leaf-first and pins hold as in the tier's), so it never pushes out other tenants' pages
  to grow past its share; a page it cannot fit within its quota (its pages all pinned) gets no
  room there. Tenants without a quota are placed exactly as without quotas.

Not thread-safe: the store calls it under its lock.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Protocol, Sequence, TypeVar

from kvstore.index import Node, PageIndex
from kvstore.policies import POLICIES, EvictionPolicy
from kvstore.tiers.base import TierFull

if TYPE_CHECKING:
    from kvstore.kv_events.recorder import KVEventRecorder


# Tiers where tenant bytes are counted and quotas hold.
QUOTA_TIERS = ("gpu", "cpu")

# A policy name from POLICIES, or a callable that makes one policy for a tier (the eviction
# benchmark passes its offline Belady policy this way; the store always passes a name).
PolicyFactory = Callable[[str], EvictionPolicy]
T = TypeVar("T")


class TierMover(Protocol):
    def copy_down(self, node: Node, src: str, dst: str) -> bool:
        """Copy the page from tier `src` to `dst` (room is already made). False: could not.
        Raises TierFull when `dst` has no slot free for it although the bytes fit."""

    def release(self, node: Node, tier: str) -> None:
        """Free the page's bytes in `tier`."""


class NullMover:
    """Moves nothing: for payload-free replays."""

    def copy_down(self, node: Node, src: str, dst: str) -> bool:
        return True

    def release(self, node: Node, tier: str) -> None:
        pass


@dataclass
class TierUsage:
    name: str
    capacity_bytes: int
    used_bytes: int = 0
    pages: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0  # pages that left this tier to make room
    demotions: int = 0  # of those, pages copied to a lower tier
    promotions: int = 0  # pages copied into this tier from a lower one on a hit
    saved_bytes: int = 0  # bytes the tier's codec saves against raw KV of the same pages


class Placement:
    def __init__(self, index: PageIndex, tiers: list[tuple[str, int]], policy: str | PolicyFactory,
                 mover: TierMover | None = None,
                 size_in: Callable[[Node, str], int] | None = None,
                 raw_size_in: Callable[[Node, str], int] | None = None,
                 tenant_of: Callable[[bytes], str | None] | None = None):
        self.index = index
        self.order = [name for name, _ in tiers]  # top first
        # Each tier's lower tiers, top first: where its victims are demoted to.
        self._below = {name: self.order[i + 1:] for i, name in enumerate(self.order)}
        self.usage = {name: TierUsage(name, capacity) for name, capacity in tiers}
        make_policy: PolicyFactory = POLICIES[policy] if isinstance(policy, str) else policy
        self.policies: dict[str, EvictionPolicy] = {name: make_policy(name) for name in self.order}
        self.mover = mover or NullMover()
        # Bytes a page takes in a tier (codecs differ per tier); payload-free replays use 1.
        self.size_in = size_in or (lambda node, tier: 1)
        # What the page would take in the tier without its codec (for `saved_bytes`).
        self.raw_size_in = raw_size_in or self.size_in
        self.dropped_pages = 0  # pages that left every tier
        # The tenant owning a namespace (None: no tenant). Must not change while the namespace
        # has pages in a memory tier: the registry only ever adds to its map.
        self.tenant_of = tenant_of or (lambda namespace: None)
        self._make_policy = make_policy
        self.quotas: dict[str, int] = {}  # tenant -> max bytes in each memory tier
        self.tenant_bytes: dict[tuple[str, str], int] = {}  # (memory tier, tenant) -> bytes held
        # (memory tier, tenant with a quota) -> a policy over that tenant's pages there only.
        self.tenant_policies: dict[tuple[str, str], EvictionPolicy] = {}
        self._learn_later = False
        # Told of every ready page entering or leaving a tier, when KV events are on (None: off).
        self.events: KVEventRecorder | None = None

    def learn_later(self, on: bool) -> None:
        """Let every policy hold its learning (set dueling's shadows) until `catch_up`."""
        self._learn_later = on
        for policy in self._every_policy():
            policy.learn_later(on)

    def catch_up(self) -> None:
        for policy in self._every_policy():
            policy.catch_up()

    def _every_policy(self) -> list[EvictionPolicy]:
        """The tiers' policies and the tenants' own ones."""
        return [*self.policies.values(), *self.tenant_policies.values()]

    def set_quota(self, tenant: str, max_bytes: int | None) -> None:
        """Cap `tenant`'s bytes in each memory tier (None: no cap). A lower cap than the tenant
        holds takes effect as its next page enters the tier (its own pages are evicted then)."""
        if max_bytes is None:
            self.quotas.pop(tenant, None)
            for tier in QUOTA_TIERS:
                self.tenant_policies.pop((tier, tenant), None)
            return
        assert max_bytes >= 0, "max_bytes must be >= 0"
        self.quotas[tenant] = max_bytes
        for tier in self.order:
            if tier not in QUOTA_TIERS or (tier, tenant) in self.tenant_policies:
                continue
            own = self.tenant_policies[(tier, tenant)] = self._make_policy(tier)
            own.learn_later(self._learn_later)
            for node in self.index.nodes.values():  # pages it already holds there
                if tier in node.tiers and self.tenant_of(node.namespace) == tenant:
                    own.insert(node)

    def _own_policy(self, node: Node, tier: str) -> EvictionPolicy | None:
        """The page's tenant's own policy in `tier`, if it has one. Callers test `tenant_policies`
        first: without quotas there is none, and a fetch touches and unpins every page."""
        tenant = self.tenant_of(node.namespace)
        return None if tenant is None else self.tenant_policies.get((tier, tenant))

    def _count_tenant(self, node: Node, tier: str, nbytes: int) -> EvictionPolicy | None:
        """Count `nbytes` (negative: leaving) to the page's tenant in a memory tier; -> that
        tenant's own policy there, if it has a quota (a parent is in its child's namespace:
        the same policy)."""
        if tier in QUOTA_TIERS:
            tenant = self.tenant_of(node.namespace)
            if tenant is not None:
                key = (tier, tenant)
                self.tenant_bytes[key] = self.tenant_bytes.get(key, 0) + nbytes
                return self.tenant_policies.get(key)
        return None

    # -- bookkeeping -------------------------------------------------------------------------
    def add(self, node: Node, tier: str, nbytes: int) -> None:
        held = node.tiers
        assert tier not in held, f"{node} already in {tier}"
        held[tier] = nbytes
        usage = self.usage[tier]
        usage.used_bytes += nbytes
        usage.pages += 1
        usage.saved_bytes += self.raw_size_in(node, tier) - nbytes
        parent = node.parent
        if parent is not None and parent.parent is not None:  # a page, not a root
            kids = parent.tier_kids
            kids[tier] = kids.get(tier, 0) + 1
        self.policies[tier].insert(node)
        own = self._count_tenant(node, tier, nbytes)
        if own is not None:
            own.insert(node)
        if self.events is not None and node.ready:  # a page being written is reported once published
            self.events.stored(node, tier)

    def admit(self, node: Node, tier: str, nbytes: int, clock: int) -> None:
        """A new page enters `tier`: pinned (it is written outside the lock), touched at `clock`
        and added (`pin`, `touch`, `add`: a page in no tier yet has no policy to touch)."""
        assert not node.tiers, f"{node} is not new"
        node.pins += 1
        node.last_access = clock
        self.add(node, tier, nbytes)

    def _discard(self, node: Node, tier: str) -> None:
        nbytes = node.tiers.pop(tier)
        if self.events is not None and node.ready:  # one never published was never reported
            self.events.removed(node, tier)
        usage = self.usage[tier]
        usage.used_bytes -= nbytes
        usage.pages -= 1
        usage.saved_bytes -= self.raw_size_in(node, tier) - nbytes
        policy = self.policies[tier]
        policy.remove(node)
        own = self._count_tenant(node, tier, -nbytes)
        if own is not None:
            own.remove(node)
        self.mover.release(node, tier)
        parent = node.parent
        if parent is not None and parent.parent is not None:  # a page, not a root
            kids = parent.tier_kids
            left = kids[tier] - 1
            kids[tier] = left
            if left == 0:
                policy.update(parent)  # it may have become an evictable leaf
                if own is not None:
                    own.update(parent)

    def touch(self, node: Node, clock: int) -> None:
        self.touch_all((node,), clock)

    def touch_all(self, nodes: Sequence[Node], clock: int) -> None:
        """`touch` each of `nodes` (a request's pages, in order) at `clock`."""
        policies, tenants = self.policies, self.tenant_policies
        for node in nodes:
            node.last_access = clock
            for tier in node.tiers:
                policies[tier].touch(node)
                if tenants and (own := self._own_policy(node, tier)) is not None:
                    own.touch(node)

    def pin(self, node: Node) -> None:
        node.pins += 1

    def pin_all(self, nodes: Sequence[Node]) -> None:
        for node in nodes:
            node.pins += 1

    def unpin(self, node: Node) -> None:
        self.unpin_all((node,))

    def unpin_all(self, nodes: Sequence[Node]) -> None:
        """`unpin` each of `nodes`, in order (a request's pages, once it is done): a page no
        longer pinned may be evictable again, which its policies are told."""
        policies, tenants = self.policies, self.tenant_policies
        lost: list[Node] | None = None
        for node in nodes:
            pins = node.pins - 1
            assert pins >= 0, "unpin without pin"
            node.pins = pins
            if pins:
                continue
            if not node.tiers:  # its last copy went bad while it was in use (remove_from)
                # Dropped once the whole path is unpinned: its subtree holds the pages after it
                # in `nodes`, which this request still pins until the loop reaches them.
                if lost is None:
                    lost = []
                lost.append(node)
                continue
            for tier in node.tiers:
                policies[tier].update(node)
                if tenants and (own := self._own_policy(node, tier)) is not None:
                    own.update(node)
        if lost is not None:
            nodes_by_key = self.index.nodes
            for node in lost:
                if nodes_by_key.get(node.key) is node and not node.pins:  # not gone with a lost page above it
                    self.drop(node)

    def fits(self, tier: str, nbytes: int) -> bool:
        usage = self.usage[tier]
        return usage.used_bytes + nbytes <= usage.capacity_bytes

    # -- eviction ----------------------------------------------------------------------------
    def make_room(self, tier: str, nbytes: int, namespace: bytes | None = None) -> bool:
        """Evict from `tier` until `nbytes` more fit. False if that is impossible (pins).

        `namespace`: the page's; if its tenant has a quota in this tier, its own pages go first
        until the page fits within the quota."""
        usage = self.usage[tier]
        if nbytes > usage.capacity_bytes:
            return False
        tenant = self.tenant_of(namespace) if namespace is not None and self.tenant_policies else None
        own = self.tenant_policies.get((tier, tenant)) if tenant is not None else None
        if own is not None and tenant is not None:
            quota, key = self.quotas[tenant], (tier, tenant)
            if nbytes > quota:
                return False
            while self.tenant_bytes.get(key, 0) + nbytes > quota:
                victim = own.victim()
                if victim is None:
                    return False
                self.evict(victim, tier)
        # `fits` and `evict_one`, inline: a full tier evicts on every store.
        while usage.used_bytes + nbytes > usage.capacity_bytes:
            victim = self.policies[tier].victim()
            if victim is None:
                return False
            self.evict(victim, tier)
        return True

    def evict_one(self, tier: str) -> bool:
        victim = self.policies[tier].victim()
        if victim is None:
            return False
        self.evict(victim, tier)
        return True

    def evicting_while_full(self, tier: str, attempt: Callable[..., T], *args: Any) -> T | None:
        """`attempt(*args)`, a slot's allocation in `tier` or a copy into one, once more after
        each eviction from `tier` while it raises TierFull: `make_room` counts bytes, and a slot
        tier's free ranges may be cut for other page sizes. None when nothing is left to evict."""
        while True:
            try:
                return attempt(*args)
            except TierFull:
                if not self.evict_one(tier):
                    return None

    def evict(self, node: Node, tier: str) -> None:
        """Move `node` out of `tier`: demote it to the first lower tier that can take it, else
        drop it (and, with its last copy, its subtree)."""
        self.usage[tier].evictions += 1
        for lower in self._below[tier]:
            if lower in node.tiers:
                break  # already held below (write-through): leaving this tier loses nothing
            node.pins += 1  # making room below must not pick the page being demoted
            try:
                room = self.make_room(lower, self.size_in(node, lower), node.namespace)
            finally:
                node.pins -= 1
            if room and self.evicting_while_full(lower, self.mover.copy_down, node, tier, lower):
                self.add(node, lower, self.size_in(node, lower))
                self.usage[tier].demotions += 1
                break
        self._discard(node, tier)
        if not node.tiers:
            self.drop(node)

    def drop(self, node: Node) -> int:
        """Remove `node` and its subtree from every tier and from the tree. Pages dropped.

        Only unpinned pages are dropped: pins are taken along whole paths (a fetch or store pins
        every page from the first one on), so an unpinned page has no pinned descendant."""
        assert node.pins == 0, f"drop of pinned {node}"
        removed = 0
        unlink = self.index.unlink
        for page in self.index.subtree(node):
            for tier in list(page.tiers):
                self._discard(page, tier)
            unlink(page)
            removed += 1
        self.dropped_pages += removed
        return removed

    def remove_from(self, node: Node, tier: str) -> None:
        """Forget a copy the tier lost on its own (a corrupt record, a failed write)."""
        if tier in node.tiers:
            self._discard(node, tier)
            if not node.tiers:
                if node.pins:
                    node.ready = False  # unmatchable now; the last unpin drops it
                else:
                    self.drop(node)
