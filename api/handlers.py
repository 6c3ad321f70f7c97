"""Thin handlers, one per route: parse (wire) -> store call (off the loop where it could wait) -> encode (wire).

The admin routes (models, stats, metrics, openapi, healthz, shm registration) are aiohttp
handlers. A data route's handler (lookup, fetch, store, chunks/store, blend) takes the app, the
connection's transport, the decoded body and the tenant, and returns either its answer, when the
work was done on the loop (no I/O, the store free, a small copy), or a `Later`: the rest of the
work, for a pool thread. Whichever server took the request runs the `Later` and writes the answer
itself: the fast path (api/fast_path.py) for a plain msgpack request whole in one read, aiohttp
(`aiohttp_handler`) for the rest. Neither hands a request it took to the other.

Nothing here validates beyond what wire.py does or decides anything the store decides; a
handler that grows past ~20 lines is a sign its logic belongs in one of those.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

import torch
from aiohttp import web

from kvstore.api import wire
from kvstore.api.context import CONFIG, EXECUTOR, LOOP_STORE, SHARED_MEMORY, STORE, run_blocking, tenant_of
from kvstore.api.metrics import METRICS
from kvstore.api.openapi import openapi_document
from kvstore.errors import StoreBusy
from kvstore.fetch_plan import FetchPlan

Answer = tuple[dict, Any]  # a data route's answer: (fields, kv bytes or None; api/wire.py fetch_answer)
Handler = Callable[[web.Application, Any, dict, "str | None"], "Answer | Later"]


async def _body(request: web.Request) -> dict:
    config = request.app[CONFIG]
    return await wire.read_request(request, config.max_body_bytes, config.body_timeout_s)


async def healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok"})


async def metrics(request: web.Request) -> web.Response:
    registry = request.app[METRICS]
    body = await run_blocking(request, registry.render)
    return web.Response(body=body, headers={"Content-Type": registry.content_type})


async def openapi(request: web.Request) -> web.Response:
    return web.json_response(openapi_document(request.app))


async def stats(request: web.Request) -> web.Response:
    return web.json_response(await run_blocking(request, request.app[STORE].stats))


async def put_model(request: web.Request) -> web.Response:
    model = wire.model_name(request.match_info["model"], field="model (path)")
    spec = wire.model_spec(await _body(request))
    tenant = tenant_of(request)
    created = await run_blocking(request, request.app[LOOP_STORE].register_model_created, model, spec, tenant=tenant)
    return wire.respond(request, spec.to_dict(), status=201 if created else 200)


async def get_model(request: web.Request) -> web.Response:
    model = wire.model_name(request.match_info["model"], field="model (path)")
    spec = await run_blocking(request, request.app[STORE].get_spec, model, tenant=tenant_of(request))
    return wire.respond(request, spec.to_dict())


async def delete_model(request: web.Request) -> web.Response:
    model = wire.model_name(request.match_info["model"], field="model (path)")
    dropped = await run_blocking(request, request.app[STORE].drop_model, model, tenant=tenant_of(request))
    return wire.respond(request, {"dropped_pages": dropped})


async def attach_shared_memory(request: web.Request) -> web.Response:
    registration = wire.shm_registration(await _body(request))
    arenas = request.app[SHARED_MEMORY]
    arena = await run_blocking(request, arenas.open, registration)
    arenas.bind(request.transport, arena)
    return wire.respond(request, {"nbytes": arena.nbytes})


def fields_of(result: Any) -> dict:
    """A result dataclass's fields as a dict for the answer. Not dataclasses.asdict: that deep-
    copies, and these results hold only ints and a dict of ints, which the answer encodes and
    drops."""
    return dict(vars(result))


def shm_region(app: web.Application, transport: Any, req: wire.TokensRequest) -> Any:
    """The request's region of its connection's shared memory (a flat uint8 tensor), or None."""
    if req.shm is None:
        return None
    offset, nbytes = req.shm
    return app[SHARED_MEMORY].arena(transport).region(offset, nbytes, field="shm")


def shm_array(app: web.Application, transport: Any, req: wire.TokensRequest) -> Any:
    """The same region as a flat uint8 numpy array (a store reads it as bytes: no tensor needed)."""
    offset, nbytes = req.shm  # type: ignore[misc]
    return app[SHARED_MEMORY].arena(transport).region_array(offset, nbytes, field="shm")


# ---- the data routes: what runs on the event loop enters the store only through `unless_busy`
# (api/loop_store.py) and never waits for it; what could wait is a `Later`.

def _nothing() -> None:
    pass


class Later:
    """A data request's work that must leave the loop: `run()` (on a pool thread) -> its answer.
    `drop()` after it, or instead of it when it will never run: it gives up what the work held
    (a fetch plan's pins)."""

    __slots__ = ("run", "drop")

    def __init__(self, run: Callable[[], Answer], drop: Callable[[], None] = _nothing):
        self.run, self.drop = run, drop


def lookup(app: web.Application, transport: Any, body: dict, tenant: str | None) -> Answer | Later:
    """A lookup only walks the in-memory index (no copies): a thread hop would cost more than the
    lookup itself. Off the loop when Redis may be probed or the store is busy."""
    req = wire.lookup_request(body)
    loop_store = app[LOOP_STORE]
    kvstore = loop_store.store
    if not loop_store.has_shared_tier:
        with loop_store.unless_busy() as free:
            if free:
                return fields_of(kvstore.lookup(req.model, req.tokens, tenant=tenant, salt=req.salt)), None
    return Later(lambda: (fields_of(kvstore.lookup(req.model, req.tokens, tenant=tenant, salt=req.salt)), None))


def fetch(app: web.Application, transport: Any, body: dict, tenant: str | None) -> Answer | Later:
    """A fetch, planned once on the loop: answered there when it needs no I/O and copies at most
    inline_copy_bytes, cheaper than the hop to a pool thread; else its plan runs on a thread (the
    prompt is not matched again). Planned on the thread too when even planning would wait (a
    Redis probe is due, or the store is busy). The answer goes into the client's shared memory
    when the request names a region of it."""
    req = wire.fetch_request(body)
    into = shm_region(app, transport, req)
    loop_store = app[LOOP_STORE]
    kvstore = loop_store.store
    if not loop_store.has_shared_tier:
        with loop_store.unless_busy() as free:
            if free:
                plan = loop_store.plan_fetch(req.model, req.tokens, start=req.start, tenant=tenant, salt=req.salt,
                                             into=into)
                if plan.needs_io or plan.nbytes > app[CONFIG].inline_copy_bytes:
                    return Later(lambda: _read(plan.run(), req, into), lambda: release_plan(app, plan))
                result = plan.run()
        if free:
            return _read(result, req, into)

    def read() -> Answer:
        return _read(kvstore.fetch(req.model, req.tokens, start=req.start, tenant=tenant, salt=req.salt, into=into),
                     req, into)
    return Later(read)


def _read(found: Any, req: wire.TokensRequest, into: Any) -> Answer:
    return wire.fetch_answer(found.matched_tokens, found.kv, req.shm, into)


def release_plan(app: web.Application, plan: FetchPlan) -> None:
    """Give up a plan nobody will run, without waiting for the store on the loop."""
    if plan.claimed:
        return
    with app[LOOP_STORE].unless_busy() as free:
        if free:
            plan.release()
            return
    try:
        app[EXECUTOR].submit(plan.release)
    except RuntimeError:  # the pool is shut down (the app is closing): no store call runs now
        plan.release()


PutKV = Callable[[Any, torch.Tensor], Any]  # (store, kv) -> StoreResult: which store method a route calls


class StoreJob:
    """Both store routes' call: it views the kv (from the body or the client's shared memory) as
    the model's (L, 2, T, H, D) tensor and passes it to `put_kv`."""

    def __init__(self, app: web.Application, transport: Any, req: wire.StoreRequest, put_kv: PutKV,
                 tenant: str | None):
        self.kvstore = app[STORE]
        self.raw = memoryview(shm_array(app, transport, req)) if req.shm else req.kv
        self.nbytes = self.raw.nbytes
        self.req, self.put_kv, self.tenant = req, put_kv, tenant

    def __call__(self) -> Answer:
        req = self.req
        spec = self.kvstore.get_spec(req.model, tenant=self.tenant)
        kv = wire.kv_tensor(self.raw, spec, len(req.tokens) - req.start, req.dtype)  # (L, 2, T, H, D)
        return fields_of(self.put_kv(self.kvstore, kv)), None


def _store(app: web.Application, job: StoreJob) -> Answer | Later:
    """Run on the loop when small, nothing but copies into memory (ServerConfig.inline_copy_bytes,
    `LoopStore.stores_in_memory`) and the store free; else on a thread."""
    if job.nbytes <= app[CONFIG].inline_copy_bytes:
        loop_store = app[LOOP_STORE]
        with loop_store.unless_busy() as free:
            if free and loop_store.stores_in_memory(job.nbytes):
                try:
                    return job()
                except StoreBusy:  # it met pages another request is still writing: wait for them on a thread
                    pass
    return Later(job)


def store(app: web.Application, transport: Any, body: dict, tenant: str | None) -> Answer | Later:
    req = wire.store_request(body)
    return _store(app, StoreJob(app, transport, req, lambda kvstore, kv: kvstore.store(
        req.model, req.tokens, kv, start=req.start, tenant=tenant, salt=req.salt), tenant))


def store_chunk(app: web.Application, transport: Any, body: dict, tenant: str | None) -> Answer | Later:
    req = wire.chunk_store_request(body)  # start is 0: a chunk is stored whole
    return _store(app, StoreJob(app, transport, req, lambda kvstore, kv: kvstore.store_chunk(
        req.model, req.tokens, kv, tenant=tenant, salt=req.salt), tenant))


def blend(app: web.Application, transport: Any, body: dict, tenant: str | None) -> Answer | Later:
    """Always on a thread: every chunk is a fetch, and K is re-rotated."""
    req = wire.blend_request(body)
    kvstore = app[STORE]

    def get() -> Answer:
        result = kvstore.blend(req.model, req.chunks, start_pos=req.start_pos, tenant=tenant, salt=req.salt)
        fields, raw = wire.kv_payload(result.kv)
        return {"hits": result.hits, "positions": [list(p) for p in result.positions], **fields}, raw
    return Later(get)


def aiohttp_handler(handler: Handler) -> Callable[[web.Request], Awaitable[web.StreamResponse]]:
    """A data route's handler as aiohttp serves it (a request the fast path did not take)."""
    async def handle(request: web.Request) -> web.StreamResponse:
        outcome = handler(request.app, request.transport, await _body(request), tenant_of(request))
        if isinstance(outcome, Later):
            later = outcome
            try:
                outcome = await run_blocking(request, later.run)
            finally:  # cancelled before the thread took it (the client left): unpin
                later.drop()
        return await wire.respond_answer(request, *outcome)
    return handle
