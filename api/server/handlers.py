"""The data routes' handlers, one per route, and their table (`DATA_ROUTES`).

A handler takes the app's state (api/server/state.py), the connection's transport (its shared memory is
bound to it), the decoded body and the tenant, and returns either its answer, when the work was
done on the loop (no I/O, the store free, a small copy), or a `Later`: the rest of the work, for a
pool thread. The data plane (api/server/fast_path.py) is their one caller: it reads the request, calls
the handler, runs a `Later` and writes the answer.

Nothing here validates beyond what wire.py does or decides anything the store decides; a
handler that grows past ~20 lines is a sign its logic belongs in one of those.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from kvstore.api.protocol import BLEND_PATH, FETCH_PATH, LOOKUP_PATH, SHM_PATH, STORE_CHUNK_PATH, STORE_PATH
from kvstore.api.server import wire
from kvstore.api.server.state import SidecarState
from kvstore.errors import StoreBusy
from kvstore.fetch_plan import FetchPlan
from kvstore.page_slice import PageSlice

Answer = tuple[dict, Any]  # a data route's answer: (fields, kv bytes or None; api/server/wire.py fetch_answer)
Handler = Callable[[SidecarState, Any, dict, "str | None"], "Answer | Later"]


def fields_of(result: Any) -> dict:
    """A result dataclass's fields as a dict for the answer. Not dataclasses.asdict: that deep-
    copies, and these results hold only ints and a dict of ints, which the answer encodes and
    drops."""
    return dict(vars(result))


def shm_region(state: SidecarState, transport: Any, req: wire.TokensRequest) -> Any:
    """The request's region of its connection's shared memory (a flat uint8 tensor), or None."""
    if req.shm is None:
        return None
    offset, nbytes = req.shm
    return state.shared_memory.arena(transport).region(offset, nbytes, field="shm")


def shm_array(state: SidecarState, transport: Any, shm: tuple[int, int]) -> Any:
    """A request's `shm` region as a flat uint8 numpy array (a store reads it as bytes: no tensor needed)."""
    offset, nbytes = shm
    return state.shared_memory.arena(transport).region_array(offset, nbytes, field="shm")


# ---- what runs on the event loop enters the store only through `unless_busy` (api/server/loop_store.py)
# and never waits for it; what could wait is a `Later`.

def _nothing() -> None:
    pass


class Later:
    """A data request's work that must leave the loop: `run()` (on a pool thread) -> its answer.
    `drop()` after it, or instead of it when it will never run: it gives up what the work held
    (a fetch plan's pins). `then(answer)`, when given, runs back on the loop before the answer is
    written (it may raise: the request then fails)."""

    __slots__ = ("run", "drop", "then")

    def __init__(self, run: Callable[[], Answer], drop: Callable[[], None] = _nothing,
                 then: Callable[[Answer], Answer] | None = None):
        self.run, self.drop, self.then = run, drop, then


def lookup(state: SidecarState, transport: Any, body: dict, tenant: str | None) -> Answer | Later:
    """A lookup only walks the in-memory index (no copies): a thread hop would cost more than the
    lookup itself. Off the loop when Redis may be probed or the store is busy."""
    req = wire.lookup_request(body)
    loop_store = state.loop_store
    kvstore = loop_store.store
    if not loop_store.has_shared_tier:
        with loop_store.unless_busy() as free:
            if free:
                return fields_of(kvstore.lookup(req.model, req.tokens, tenant=tenant, salt=req.salt)), None
    return Later(lambda: (fields_of(kvstore.lookup(req.model, req.tokens, tenant=tenant, salt=req.salt)), None))


def fetch(state: SidecarState, transport: Any, body: dict, tenant: str | None) -> Answer | Later:
    """A fetch, planned once on the loop: answered there when it needs no I/O and copies at most
    inline_copy_bytes, cheaper than the hop to a pool thread; else its plan runs on a thread (the
    prompt is not matched again). Planned on the thread too when even planning would wait (a
    Redis probe is due, or the store is busy). The answer goes into the client's shared memory
    when the request names a region of it."""
    req = wire.fetch_request(body)
    into = shm_region(state, transport, req)
    loop_store = state.loop_store
    kvstore = loop_store.store
    if not loop_store.has_shared_tier:
        with loop_store.unless_busy() as free:
            if free:
                plan = loop_store.plan_fetch(req.model, req.tokens, start=req.start, tenant=tenant, salt=req.salt,
                                             into=into, heads=req.heads, layers=req.layers)
                if plan.needs_io or plan.nbytes > state.config.inline_copy_bytes:
                    return Later(lambda: _read(plan.run(), req, into), lambda: release_plan(state, plan))
                result = plan.run()
        if free:
            return _read(result, req, into)

    def read() -> Answer:
        return _read(kvstore.fetch(req.model, req.tokens, start=req.start, tenant=tenant, salt=req.salt, into=into,
                                   heads=req.heads, layers=req.layers), req, into)
    return Later(read)


def _read(found: Any, req: wire.TokensRequest, into: Any) -> Answer:
    return wire.fetch_answer(found.matched_tokens, found.kv, req.shm, into)


def release_plan(state: SidecarState, plan: FetchPlan) -> None:
    """Give up a plan nobody will run, without waiting for the store on the loop."""
    if plan.claimed:
        return
    with state.loop_store.unless_busy() as free:
        if free:
            plan.release()
            return
    try:
        state.executor.submit(plan.release)
    except RuntimeError:  # the pool is shut down (the app is closing): no store call runs now
        plan.release()


PutKV = Callable[[Any, torch.Tensor], Any]  # (store, kv) -> StoreResult: which store method a route calls


class StoreJob:
    """Both store routes' call: it views the kv (from the body or the client's shared memory) as
    the model's (L, 2, T, H, D) tensor and passes it to `put_kv`."""

    def __init__(self, state: SidecarState, transport: Any, req: wire.StoreRequest, put_kv: PutKV,
                 tenant: str | None):
        self.kvstore = state.store
        self.raw = memoryview(shm_array(state, transport, req.shm)) if req.shm else req.kv
        self.nbytes = self.raw.nbytes
        self.req, self.put_kv, self.tenant = req, put_kv, tenant

    def __call__(self) -> Answer:
        req = self.req
        spec = self.kvstore.get_spec(req.model, tenant=self.tenant)
        part = PageSlice.of(spec, layers=req.layers, heads=req.heads)
        kv = wire.kv_tensor(self.raw, spec, len(req.tokens) - req.start, req.dtype, part)  # (L, 2, T, H, D)
        return fields_of(self.put_kv(self.kvstore, kv)), None


def _store(state: SidecarState, job: StoreJob) -> Answer | Later:
    """Run on the loop when small, nothing but copies into memory (ServerConfig.inline_copy_bytes,
    `LoopStore.stores_in_memory`) and the store free; else on a thread. A part of pages always
    runs on a thread: a page it completes is stored whole then, which may wait for other stores."""
    if job.nbytes <= state.config.inline_copy_bytes and job.req.heads is None and job.req.layers is None:
        loop_store = state.loop_store
        with loop_store.unless_busy() as free:
            if free and loop_store.stores_in_memory(job.nbytes):
                try:
                    return job()
                except StoreBusy:  # it met pages another request is still writing: wait for them on a thread
                    pass
    return Later(job)


def store(state: SidecarState, transport: Any, body: dict, tenant: str | None) -> Answer | Later:
    req = wire.store_request(body)
    return _store(state, StoreJob(state, transport, req, lambda kvstore, kv: kvstore.store(
        req.model, req.tokens, kv, start=req.start, tenant=tenant, salt=req.salt, heads=req.heads,
        layers=req.layers), tenant))


def store_chunk(state: SidecarState, transport: Any, body: dict, tenant: str | None) -> Answer | Later:
    req = wire.chunk_store_request(body)  # start is 0: a chunk is stored whole
    return _store(state, StoreJob(state, transport, req, lambda kvstore, kv: kvstore.store_chunk(
        req.model, req.tokens, kv, tenant=tenant, salt=req.salt), tenant))


def blend(state: SidecarState, transport: Any, body: dict, tenant: str | None) -> Answer | Later:
    """Always on a thread: every chunk is a fetch, and K is re-rotated."""
    req = wire.blend_request(body)
    kvstore = state.store

    def get() -> Answer:
        result = kvstore.blend(req.model, req.chunks, start_pos=req.start_pos, tenant=tenant, salt=req.salt)
        fields, raw = wire.kv_payload(result.kv)
        return {"hits": result.hits, "positions": [list(p) for p in result.positions], **fields}, raw
    return Later(get)


def attach_shared_memory(state: SidecarState, transport: Any, body: dict, tenant: str | None) -> Later:
    """Registers the client's memfd for this connection (api/server/shared_memory.py): opened and mapped
    on a thread (it opens /proc/<pid>/fd/<fd>), bound to the transport back on the loop, which
    owns the table of registrations."""
    registration = wire.shm_registration(body)
    arenas = state.shared_memory
    opened: list[Any] = []

    def open_arena() -> Answer:
        opened.append(arenas.open(registration))
        return {"nbytes": opened[0].nbytes}, None

    def bind(answer: Answer) -> Answer:
        arenas.bind(transport, opened[0])
        return answer
    return Later(open_arena, then=bind)


# Every data route (POST): the data plane's whole dispatch table.
DATA_ROUTES: dict[str, Handler] = {
    LOOKUP_PATH: lookup,
    STORE_PATH: store,
    FETCH_PATH: fetch,
    STORE_CHUNK_PATH: store_chunk,
    BLEND_PATH: blend,
    SHM_PATH: attach_shared_memory,
}
