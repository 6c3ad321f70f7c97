"""Thin handlers: parse (wire) -> store call (off the loop where it could wait) -> encode (wire).

Nothing here validates beyond what wire.py does or decides anything the store decides; a
handler that grows past ~20 lines is a sign its logic belongs in one of those.
"""
from __future__ import annotations

from typing import Any, Callable

import torch
from aiohttp import web

from kvstore.api import wire
from kvstore.api.context import CONFIG, EXECUTOR, SHARED_MEMORY, STORE, run_blocking, tenant_of
from kvstore.api.metrics import METRICS
from kvstore.api.openapi import openapi_document
from kvstore.errors import StoreBusy
from kvstore.fetch_plan import FetchPlan


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
    store, tenant = request.app[STORE], tenant_of(request)
    created = await run_blocking(request, store.register_model_created, model, spec, tenant=tenant)
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


# ---- what runs on the event loop: shared with api/fast_path.py, which answers the same requests
# before aiohttp's request machinery. The loop never waits for the store: each of these enters it
# only through `unless_busy` and returns None (the work goes to a pool thread) when another
# thread holds it, or when the work could wait on I/O.

# A fetch the fast path planned but left to aiohttp (it needs I/O), handed to its handler.
HANDED_PLAN: Any = web.RequestKey("handed_plan", FetchPlan) if hasattr(web, "RequestKey") else "kvstore.handed_plan"


def lookup_inline(app: web.Application, req: wire.TokensRequest, tenant: str | None) -> dict | None:
    """A lookup only walks the in-memory index (no copies): a thread hop would cost more than the
    lookup itself. Off the loop when Redis may be probed or the store is busy."""
    kvstore = app[STORE]
    if kvstore.has_shared_tier:
        return None
    with kvstore.unless_busy() as free:
        return fields_of(kvstore.lookup(req.model, req.tokens, tenant=tenant, salt=req.salt)) if free else None


def fetch_inline(app: web.Application, req: wire.TokensRequest, tenant: str | None,
                 into: Any) -> tuple[dict, Any] | FetchPlan | None:
    """A fetch, planned once on the loop: its answer (fields, kv bytes or None; api/wire.py
    fetch_answer) when it needs no I/O and copies at most inline_copy_bytes, cheaper here than the
    hop to a pool thread; else its plan, for `run_plan` on a thread; None when even planning would
    wait (a Redis probe is due, or the store is busy): `fetch_job` then plans on the thread.
    `into`: the client's memory to answer into (`shm_region`), or None."""
    kvstore = app[STORE]
    if kvstore.has_shared_tier:
        return None
    with kvstore.unless_busy() as free:
        if not free:
            return None
        plan = kvstore.plan_fetch(req.model, req.tokens, start=req.start, tenant=tenant, salt=req.salt, into=into)
        if plan.needs_io or plan.nbytes > app[CONFIG].inline_copy_bytes:
            return plan
        result = plan.run()
    return wire.fetch_answer(result.matched_tokens, result.kv, req.shm, into)


def release_plan(app: web.Application, plan: FetchPlan) -> None:
    """Give up a plan nobody will run, without waiting for the store on the loop."""
    if plan.claimed:
        return
    with app[STORE].unless_busy() as free:
        if free:
            plan.release()
            return
    try:
        app[EXECUTOR].submit(plan.release)
    except RuntimeError:  # the pool is shut down (the app is closing): no store call runs now
        plan.release()


async def run_plan(request: web.Request, plan: FetchPlan, req: wire.TokensRequest, into: Any) -> tuple[dict, Any]:
    """A planned fetch's answer, read on a pool thread (kv_payload copies a strided kv: off the loop too)."""
    def read() -> tuple[dict, Any]:
        found = plan.run()
        return wire.fetch_answer(found.matched_tokens, found.kv, req.shm, into)

    try:
        return await run_blocking(request, read)
    finally:  # cancelled before the thread took it (the client left): unpin it
        release_plan(request.app, plan)


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

    def __call__(self) -> dict:
        req = self.req
        spec = self.kvstore.get_spec(req.model, tenant=self.tenant)
        kv = wire.kv_tensor(self.raw, spec, len(req.tokens) - req.start, req.dtype)  # (L, 2, T, H, D)
        return fields_of(self.put_kv(self.kvstore, kv))


def store_inline(app: web.Application, job: StoreJob) -> dict | None:
    """A store's answer when it ran on the loop: small, nothing but copies into memory
    (ServerConfig.inline_copy_bytes, `KVStore.stores_in_memory`) and the store free; else None."""
    if job.nbytes > app[CONFIG].inline_copy_bytes:
        return None
    kvstore = app[STORE]
    with kvstore.unless_busy() as free:
        if not free or not kvstore.stores_in_memory(job.nbytes):
            return None
        try:
            return job()
        except StoreBusy:  # it met pages another request is still writing: wait for them on a thread
            return None


def put_pages(req: wire.StoreRequest, tenant: str | None) -> PutKV:
    return lambda kvstore, kv: kvstore.store(req.model, req.tokens, kv, start=req.start, tenant=tenant, salt=req.salt)


def put_chunk(req: wire.StoreRequest, tenant: str | None) -> PutKV:
    return lambda kvstore, kv: kvstore.store_chunk(req.model, req.tokens, kv, tenant=tenant, salt=req.salt)


# ---- the data routes ---------------------------------------------------------------------------

async def lookup(request: web.Request) -> web.Response:
    req = wire.lookup_request(await _body(request))
    kvstore, tenant = request.app[STORE], tenant_of(request)
    answer = lookup_inline(request.app, req, tenant)
    if answer is None:
        answer = fields_of(await run_blocking(request, kvstore.lookup, req.model, req.tokens, tenant=tenant,
                                                    salt=req.salt))
    return wire.respond(request, answer)


async def store(request: web.Request) -> web.Response:
    req = wire.store_request(await _body(request))
    return await _store(request, req, put_pages(req, tenant_of(request)))


async def _store(request: web.Request, req: wire.StoreRequest, put_kv: PutKV) -> web.Response:
    job = StoreJob(request.app, request.transport, req, put_kv, tenant_of(request))
    answer = store_inline(request.app, job)
    return wire.respond(request, answer if answer is not None else await run_blocking(request, job))


async def fetch(request: web.Request) -> web.StreamResponse:
    req = wire.fetch_request(await _body(request))
    kvstore, tenant = request.app[STORE], tenant_of(request)
    into = shm_region(request.app, request.transport, req)
    found = request.pop(HANDED_PLAN, None) or fetch_inline(request.app, req, tenant, into)
    if isinstance(found, FetchPlan):
        answer = await run_plan(request, found, req, into)
    elif found is None:
        answer = await run_blocking(request, lambda: _fetch_answer(kvstore, req, tenant, into))
    else:
        answer = found
    return await wire.respond_answer(request, *answer)


def _fetch_answer(kvstore: Any, req: wire.TokensRequest, tenant: str | None, into: Any) -> tuple[dict, Any]:
    found = kvstore.fetch(req.model, req.tokens, start=req.start, tenant=tenant, salt=req.salt, into=into)
    return wire.fetch_answer(found.matched_tokens, found.kv, req.shm, into)


async def store_chunk(request: web.Request) -> web.Response:
    req = wire.chunk_store_request(await _body(request))  # start is 0: a chunk is stored whole
    return await _store(request, req, put_chunk(req, tenant_of(request)))


async def blend(request: web.Request) -> web.StreamResponse:
    req = wire.blend_request(await _body(request))
    kvstore, tenant = request.app[STORE], tenant_of(request)

    def get() -> tuple[dict, object]:
        result = kvstore.blend(req.model, req.chunks, start_pos=req.start_pos, tenant=tenant, salt=req.salt)
        fields, raw = wire.kv_payload(result.kv)
        return {"hits": result.hits, "positions": [list(p) for p in result.positions], **fields}, raw

    fields, raw = await run_blocking(request, get)
    return await wire.respond_answer(request, fields, raw)
