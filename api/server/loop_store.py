"""The store as the sidecar's event loop calls it: never waiting, a fetch matched once.

`KVStore`'s public surface is what an embedder calls: blocking, thread-safe calls. The event loop
needs more than that, and this adapter is where it lives, owned by the api: enter the store only
when no other thread holds it (`unless_busy`), know beforehand whether a call could wait on I/O
(`has_shared_tier`, `stores_in_memory`), plan a fetch on the loop and run it on a pool thread
(`plan_fetch`), and let the eviction policy learn once an answer is out (`learn_later`,
`catch_up_unless_busy`).

It reaches into the store deliberately: its state (`_state`: the lock, `must_not_wait`), its
tiers and placement, and `_plan_fetch` (what `fetch` runs). Those are the store's internals; a
change there is a change here, and nothing else outside the store touches them.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from kvstore.fetch_plan import FetchPlan
from kvstore.store_state import StoreState


class LoopStore:
    """One store, as the event loop uses it. `store` stays the `KVStore` for every blocking call."""

    __slots__ = ("store", "_state")

    def __init__(self, store: Any):
        self.store = store
        self._state: StoreState = store._state

    def unless_busy(self) -> "UnlessBusy":
        """As `with loop_store.unless_busy() as free:` True, and the calling thread holds the
        store until the block ends, if no other thread held it; False, and nothing held, if one
        did (it may be copying, promoting or queueing disk writes).

        Store calls inside the block take the lock again without waiting. Inside, do only work
        that waits on nothing (no shared-tier probe, no disk, small copies): other threads wait
        for the block to end. A store that would have to wait for pages another thread is
        writing raises `StoreBusy` instead, having done nothing."""
        return UnlessBusy(self._state)

    @property
    def has_shared_tier(self) -> bool:
        """True with a Redis tier: lookup and fetch may then do network I/O (probing Redis)."""
        return self._state.tiers.shared is not None

    def stores_in_memory(self, nbytes: int) -> bool:
        """Whether storing `nbytes` of new KV now would only copy into memory: write-back, a
        memory top tier, and no eviction that writes a record tier (the disk writer's bounded
        queue can block)."""
        state = self._state
        tiers = state.tiers
        if self.store.config.durability != "write-back" or not tiers.keeps_slots(tiers.top):
            return False
        if tiers.memory_only:
            return True  # evictions only drop pages
        with state.lock:
            return not state.placement.quotas and state.placement.fits(tiers.top, nbytes)

    def plan_fetch(self, model: str, tokens: Sequence[int], *, start: int, tenant: str | None, salt: str | None,
                   into: torch.Tensor | None, heads: Any = None, layers: Any = None) -> FetchPlan:
        """What `KVStore.fetch` would read, matched and pinned: `needs_io` says whether reading it
        waits on a record tier, `nbytes` how much it answers. `run()` it once, on any thread, or
        `release()` it. Called on the loop only inside `unless_busy` and without a shared tier
        (planning then probes nothing)."""
        return self.store._plan_fetch(model, tokens, start=start, tenant=tenant, salt=salt, into=into, heads=heads,
                                      layers=layers)

    def learn_later(self, on: bool) -> None:
        """`KVStore.learn_later`: the app holds the policy's learning for after its answers."""
        self.store.learn_later(on)

    def catch_up_unless_busy(self) -> bool:
        """Do the learning held back, unless another thread holds the store (then False, nothing
        done): the loop retries rather than wait."""
        state = self._state
        if not state.lock.acquire(blocking=False):
            return False
        try:
            state.placement.catch_up()
        finally:
            state.lock.release()
        return True

    def register_model_created(self, model: str, spec: Any, *, tenant: str | None) -> bool:
        """`KVStore.register_model`, True when this call created the registration (HTTP 201)."""
        return self.store._register_model(model, spec, tenant=tenant)


class UnlessBusy:
    """`LoopStore.unless_busy`'s block: a non-blocking acquire of the store's lock, released at
    the end of the block if it was taken; while it is held, the store must not wait
    (`StoreState.must_not_wait`). (A class: a generator context manager costs a few times more,
    on every request the event loop answers.)"""

    __slots__ = ("state", "free", "outer")

    def __init__(self, state: StoreState):
        self.state = state
        self.free = False
        self.outer = False  # must_not_wait as this block found it (blocks may nest)

    def __enter__(self) -> bool:
        state = self.state
        self.free = free = state.lock.acquire(blocking=False)
        if free:
            self.outer = state.must_not_wait
            state.must_not_wait = True
        return free

    def __exit__(self, *exc: Any) -> None:
        if self.free:
            state = self.state
            state.must_not_wait = self.outer
            state.lock.release()
