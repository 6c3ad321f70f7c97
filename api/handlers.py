"""Thin handlers: parse (wire) -> store call (off the loop where it blocks) -> encode (wire).

Nothing here validates beyond what wire.py does or decides anything the store decides; a
handler that grows past ~20 lines is a sign its logic belongs in one of those.
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Callable

from aiohttp import web

from api import wire
from api.context import CONFIG, SHARED_MEMORY, STORE, run_blocking, tenant_of
from api.metrics import METRICS
from api.openapi import openapi_document


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


def _shm_region(request: web.Request, req: wire.TokensRequest) -> Any:
    """The request's region of its connection's shared memory (a flat uint8 tensor), or None."""
    if req.shm is None:
        return None
    offset, nbytes = req.shm
    return request.app[SHARED_MEMORY].arena(request.transport).region(offset, nbytes, field="shm")


def _shm_kv(request: web.Request, req: wire.TokensRequest) -> memoryview:
    """The kv bytes of a store that sent them through shared memory."""
    return memoryview(_shm_region(request, req).numpy())


def _inline_store(request: web.Request, nbytes: int) -> bool:
    """Run a store on the loop: small, and nothing but copies into memory (ServerConfig.inline_copy_bytes)."""
    return nbytes <= request.app[CONFIG].inline_copy_bytes and request.app[STORE].stores_in_memory(nbytes)


async def lookup(request: web.Request) -> web.Response:
    req = wire.lookup_request(await _body(request))
    kvstore, tenant = request.app[STORE], tenant_of(request)
    # On the loop unless Redis may be probed: a lookup only walks the in-memory index (no copies),
    # and a thread hop would cost more than the lookup itself.
    if kvstore.has_shared_tier:
        result = await run_blocking(request, kvstore.lookup, req.model, req.tokens, tenant=tenant)
    else:
        result = kvstore.lookup(req.model, req.tokens, tenant=tenant)
    return wire.respond(request, asdict(result))


async def store(request: web.Request) -> web.Response:
    req = wire.store_request(await _body(request))
    return await _store(request, req, lambda kvstore, kv: kvstore.store(
        req.model, req.tokens, kv, start=req.start, tenant=tenant_of(request)))


async def _store(request: web.Request, req: wire.StoreRequest, put_kv: Callable[[Any, Any], Any]) -> web.Response:
    """Both store routes: the kv (from the body or the client's shared memory) viewed as the
    model's (L, 2, T, H, D) tensor, then `put_kv(store, kv)`, on the loop when it needs no I/O."""
    kvstore, tenant = request.app[STORE], tenant_of(request)
    raw = _shm_kv(request, req) if req.shm else req.kv

    def put() -> dict:
        spec = kvstore.get_spec(req.model, tenant=tenant)
        kv = wire.kv_tensor(raw, spec, len(req.tokens) - req.start, req.dtype)  # (L, 2, T, H, D)
        return asdict(put_kv(kvstore, kv))

    return wire.respond(request, put() if _inline_store(request, raw.nbytes) else await run_blocking(request, put))


async def fetch(request: web.Request) -> web.StreamResponse:
    req = wire.fetch_request(await _body(request))
    kvstore, tenant = request.app[STORE], tenant_of(request)
    into = _shm_region(request, req)  # the client's memory to answer into, if it named some
    # No I/O and at most inline_copy_bytes to copy: cheaper here than the hop to a pool thread.
    limit = request.app[CONFIG].inline_copy_bytes
    result = kvstore.fetch_in_memory(req.model, req.tokens, max_bytes=limit, start=req.start, tenant=tenant,
                                     into=into) if limit else None
    if result is not None:
        return await wire.respond_fetch(request, result.matched_tokens, wire.kv_payload(result.kv), req.shm, into)

    def get() -> tuple[int, tuple[dict, object]]:
        found = kvstore.fetch(req.model, req.tokens, start=req.start, tenant=tenant, into=into)
        return found.matched_tokens, wire.kv_payload(found.kv)  # copies a strided kv: off the loop

    matched, payload = await run_blocking(request, get)
    return await wire.respond_fetch(request, matched, payload, req.shm, into)


async def store_chunk(request: web.Request) -> web.Response:
    req = wire.chunk_store_request(await _body(request))  # start is 0: a chunk is stored whole
    return await _store(request, req, lambda kvstore, kv: kvstore.store_chunk(
        req.model, req.tokens, kv, tenant=tenant_of(request)))


async def blend(request: web.Request) -> web.StreamResponse:
    req = wire.blend_request(await _body(request))
    kvstore, tenant = request.app[STORE], tenant_of(request)

    def get() -> tuple[dict, object]:
        result = kvstore.blend(req.model, req.chunks, start_pos=req.start_pos, tenant=tenant)
        fields, raw = wire.kv_payload(result.kv)
        return {"hits": result.hits, "positions": [list(p) for p in result.positions], **fields}, raw

    fields, raw = await run_blocking(request, get)
    return await wire.respond_kv(request, fields, raw)
