"""`GET /openapi.json`: an OpenAPI 3.1 document of the sidecar, built from the live route tables
(the data plane's and aiohttp's).

`OPERATIONS` describes each (method, path); the document lists exactly the app's routes, so a
route without a description shows up as "undocumented" (and fails tests/api/test_openapi.py)
rather than silently missing. Request bodies are msgpack maps; the schemas below describe
their fields (a `bin` is `type: string, format: binary`).
"""
from __future__ import annotations

import re

from typing import Any

from aiohttp import web

from kvstore.api.server.handlers import DATA_ROUTES
from kvstore.config import CODECS, DTYPE_BYTES, ROPE_STYLES

MSGPACK = "application/msgpack"
JSON = "application/json"

_int = {"type": "integer", "minimum": 0}
_model = {"type": "string", "minLength": 1, "description": "model name"}
_tokens = {"description": "token ids: an array of ints, or a bin of little-endian int32",
           "oneOf": [{"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 2**31 - 1}},
                     {"type": "string", "format": "binary"}]}
_kv: dict[str, Any] = {"type": "string", "format": "binary",
       "description": "the (L, 2, T, H, D) KV tensor, C-order, the model's dtype, little-endian "
                      "(base64 in a JSON body)"}
_start = {**_int, "default": 0, "description": "first token the kv covers / to return"}
_shm: dict[str, Any] = {"type": "object", "required": ["offset", "nbytes"], "additionalProperties": False,
        "properties": {"offset": _int, "nbytes": _int},
        "description": "a region of the shared memory this connection registered (POST /v1/shm)"}
# 256 characters are at most 1024 bytes of UTF-8 (MAX_SALT_BYTES): the store checks the bytes.
_salt = {"type": "string", "minLength": 1, "maxLength": 256,
         "description": "cache salt (vLLM's cache_salt): pages stored under a salt are found under that salt "
                        "only, within the caller's tenant; absent: no salt"}

_range = {"type": "array", "items": _int, "minItems": 2, "maxItems": 2}
_heads = {**_range, "description": "[start, stop) of the model's KV heads (a tensor-parallel rank's): kv holds "
                                   "only these; a page is served once all its heads are stored"}
_layers = {**_range, "description": "[start, stop) of the model's layers (a pipeline stage's), as heads"}

SCHEMAS: dict[str, Any] = {
    "ModelSpec": {
        "type": "object", "required": ["num_layers", "num_kv_heads", "head_dim"], "additionalProperties": False,
        "properties": {
            "num_layers": {"type": "integer", "minimum": 1}, "num_kv_heads": {"type": "integer", "minimum": 1},
            "head_dim": {"type": "integer", "minimum": 1}, "dtype": {"enum": list(DTYPE_BYTES)},
            "page_size": {"type": "integer", "minimum": 1}, "rope_theta": {"type": "number", "exclusiveMinimum": 0},
            "rope_style": {"enum": list(ROPE_STYLES)},
            "rope_scaling": {"type": ["object", "null"], "description": "HF-style rope_scaling"}}},
    "LookupRequest": {"type": "object", "required": ["model", "tokens"], "additionalProperties": False,
                      "properties": {"model": _model, "tokens": _tokens, "salt": _salt}},
    "LookupResult": {"type": "object", "required": ["matched_tokens", "tiers"],
                     "properties": {"matched_tokens": _int,
                                    "tiers": {"type": "object", "additionalProperties": _int,
                                              "description": "tier -> matched tokens it serves"}}},
    "StoreRequest": {"type": "object", "required": ["model", "tokens"], "additionalProperties": False,
                     "description": "exactly one of kv and shm",
                     "properties": {"model": _model, "tokens": _tokens,
                                    "kv": {**_kv, "description": _kv["description"] + "; covers tokens[start:]"},
                                    "shm": {**_shm, "description": "where kv's bytes are, instead of kv: "
                                                                   + _shm["description"]},
                                    "start": _start, "salt": _salt, "heads": _heads, "layers": _layers,
                                    "dtype": {"enum": list(DTYPE_BYTES),
                                              "description": "optional check of kv's dtype"}}},
    "StoreResult": {"type": "object", "required": ["stored_tokens", "new_pages"],
                    "properties": {"stored_tokens": _int, "new_pages": _int}},
    "FetchRequest": {"type": "object", "required": ["model", "tokens"], "additionalProperties": False,
                     "properties": {"model": _model, "tokens": _tokens, "start": _start, "salt": _salt,
                                    "heads": {**_range, "description": "answer only these KV heads"},
                                    "layers": {**_range, "description": "answer only these layers"},
                                    "shm": {**_shm, "description": "write the answer's kv here if it fits: "
                                                                   + _shm["description"]}}},
    "FetchResult": {"type": "object", "required": ["matched_tokens"],
                    "description": "kv, or shm when the kv was written to shared memory",
                    "properties": {"matched_tokens": _int,
                                   "kv": {**_kv, "type": ["string", "null"],
                                          "description": "covers tokens[start:matched_tokens]; null on a miss"},
                                   "shm": {**_shm, "description": "the kv's bytes were written at this region "
                                                                  "of the shared memory"},
                                   "dtype": {"enum": list(DTYPE_BYTES)},
                                   "shape": {"type": "array", "items": _int, "minItems": 5, "maxItems": 5}}},
    "ChunkStoreRequest": {"type": "object", "required": ["model", "tokens"], "additionalProperties": False,
                          "description": "exactly one of kv and shm",
                          "properties": {"model": _model, "tokens": _tokens,
                                         "kv": {**_kv, "description": _kv["description"]
                                                + "; the chunk computed standalone at positions 0..T-1"},
                                         "shm": {**_shm, "description": "where kv's bytes are, instead of kv: "
                                                                        + _shm["description"]},
                                         "salt": _salt,
                                         "dtype": {"enum": list(DTYPE_BYTES),
                                                   "description": "optional check of kv's dtype"}}},
    "BlendRequest": {"type": "object", "required": ["model", "chunks"], "additionalProperties": False,
                     "properties": {"model": _model, "chunks": {"type": "array", "minItems": 1, "items": _tokens},
                                    "salt": _salt,
                                    "start_pos": {**_int, "default": 0,
                                                  "description": "position of the first chunk's first token"}}},
    "BlendResult": {"type": "object", "required": ["hits", "positions", "kv"],
                    "properties": {"hits": {"type": "array", "items": {"type": "boolean"},
                                            "description": "per chunk: the store held all of it"},
                                   "positions": {"type": "array",
                                                 "items": {"type": "array", "items": _int,
                                                           "minItems": 2, "maxItems": 2},
                                                 "description": "per chunk: [start, end) positions in the new prompt"},
                                   "kv": {**_kv, "description": "the chunks' KV end to end, K re-rotated to "
                                                                "`positions`; missed chunks are zeros"},
                                   "dtype": {"enum": list(DTYPE_BYTES)},
                                   "shape": {"type": "array", "items": _int, "minItems": 5, "maxItems": 5}}},
    "SharedMemoryRequest": {
        "type": "object", "required": ["pid", "fd", "nbytes", "secret"], "additionalProperties": False,
        "description": "a memfd of the client (same host and user), sealed against shrinking, "
                       "whose first 32 bytes are `secret`",
        "properties": {"pid": {"type": "integer", "minimum": 1}, "fd": _int, "nbytes": _int,
                       "secret": {"type": "string", "format": "binary", "minLength": 32, "maxLength": 32}}},
    "SharedMemoryResult": {"type": "object", "required": ["nbytes"], "properties": {"nbytes": _int}},
    "AuditRequest": {"type": "object", "required": ["model", "tokens", "passed"], "additionalProperties": False,
                     "description": "an engine's audit of the KV it reused for tokens' cached prefix",
                     "properties": {"model": _model, "tokens": _tokens, "salt": _salt,
                                    "passed": {"type": "boolean"},
                                    "layer": {"type": ["integer", "null"], "minimum": 0,
                                              "description": "the first layer whose K or V failed"},
                                    "tier": {"type": ["string", "null"],
                                             "description": "the tier that served the audited page; absent or "
                                                            "null: the tier holding it now"},
                                    "chunk": {"type": "boolean", "default": False,
                                              "description": "tokens are a CacheBlend chunk (stored with "
                                                             "store-chunk): its own tree is the path"}}},
    "AuditResult": {"type": "object", "required": ["dropped_pages", "kept_pages"],
                    "properties": {"dropped_pages": _int, "kept_pages": _int}},
    "DropResult": {"type": "object", "required": ["dropped_pages"], "properties": {"dropped_pages": _int}},
    "Stats": {"type": "object", "description": "per tier: pages, bytes, capacity, hits, misses, evictions; "
                                               f"corrupt_records; tier codecs among {', '.join(CODECS)}"},
    "Health": {"type": "object", "properties": {"status": {"const": "ok"}}},
    "Error": {"type": "object", "required": ["error"],
              "properties": {"error": {"type": "object", "required": ["code", "message"],
                                       "properties": {"code": {"type": "string"},
                                                      "message": {"type": "string",
                                                                  "description": "names the field at fault"}}}}},
}


def _ref(name: str) -> dict[str, str]:
    return {"$ref": f"#/components/schemas/{name}"}


def _body(name: str) -> dict[str, Any]:
    return {"required": True, "content": {MSGPACK: {"schema": _ref(name)}, JSON: {"schema": _ref(name)}}}


def _ok(name: str, media: tuple[str, ...] = (MSGPACK, JSON), status: str = "200", text: str = "OK") -> dict[str, Any]:
    return {status: {"description": text, "content": {m: {"schema": _ref(name)} for m in media}}}


def _errors(*statuses: int) -> dict[str, Any]:
    return {str(s): {"description": d,
                     "content": {MSGPACK: {"schema": _ref("Error")}, JSON: {"schema": _ref("Error")}}}
            for s, d in ((400, "bad input; the message names the field"), (401, "missing or unknown bearer token"),
                         (403, "shared memory refused: disabled, another host or user, not a sealed memfd, "
                               "wrong secret, or none registered on this connection"),
                         (404, "unknown model"), (409, "a different spec is registered under this name"),
                         (413, "body over --max-body-bytes"), (415, "Content-Type is neither msgpack nor JSON"),
                         (422, "the model's RoPE scaling cannot be re-rotated exactly (dynamic, yarn, longrope)"),
                         (507, "no tier can take the pages")) if s in statuses}


_path_model = [{"name": "model", "in": "path", "required": True, "schema": _model}]
_v1 = (401,)
OPERATIONS: dict[tuple[str, str], dict[str, Any]] = {
    ("GET", "/healthz"): {"summary": "Liveness", "responses": _ok("Health", (JSON,))},
    ("GET", "/metrics"): {"summary": "Prometheus metrics", "responses": {
        "200": {"description": "Prometheus text format", "content": {"text/plain": {"schema": {"type": "string"}}}}}},
    ("GET", "/openapi.json"): {"summary": "This document", "responses": {
        "200": {"description": "OpenAPI 3.1", "content": {JSON: {"schema": {"type": "object"}}}}}},
    ("GET", "/v1/stats"): {"summary": "Per-tier store statistics",
                           "responses": {**_ok("Stats", (JSON,)), **_errors(*_v1)}},
    ("POST", "/v1/audit"): {"summary": "Count an engine's audit of reused KV; a failed one drops the matched path "
                                       "in every tier",
                            "requestBody": _body("AuditRequest"),
                            "responses": {**_ok("AuditResult"), **_errors(400, 401, 404, 413, 415)}},
    ("PUT", "/v1/models/{model}"): {
        "summary": "Register a model's KV layout (idempotent)", "parameters": _path_model,
        "requestBody": _body("ModelSpec"),
        "responses": {**_ok("ModelSpec", text="the same spec was already registered"),
                      **_ok("ModelSpec", status="201", text="registered"), **_errors(400, 401, 409, 413, 415)}},
    ("GET", "/v1/models/{model}"): {"summary": "A registered model's spec", "parameters": _path_model,
                                    "responses": {**_ok("ModelSpec"), **_errors(400, 401, 404)}},
    ("DELETE", "/v1/models/{model}"): {"summary": "Drop the model's pages in every tier", "parameters": _path_model,
                                       "responses": {**_ok("DropResult"), **_errors(400, 401, 404)}},
    ("POST", "/v1/shm"): {"summary": "Register the client's shared memory on this connection (same host only)",
                          "requestBody": _body("SharedMemoryRequest"),
                          "responses": {**_ok("SharedMemoryResult"), **_errors(400, 401, 403, 413, 415)}},
    ("POST", "/v1/lookup"): {"summary": "How many leading tokens are cached, per tier",
                             "requestBody": _body("LookupRequest"),
                             "responses": {**_ok("LookupResult"), **_errors(400, 401, 404, 413, 415)}},
    ("POST", "/v1/store"): {"summary": "Store the KV of tokens[start:]", "requestBody": _body("StoreRequest"),
                            "responses": {**_ok("StoreResult"), **_errors(400, 401, 403, 404, 413, 415, 507)}},
    ("POST", "/v1/fetch"): {"summary": "The cached KV of the longest matching prefix, from start",
                            "requestBody": _body("FetchRequest"),
                            "responses": {**_ok("FetchResult"), **_errors(400, 401, 403, 404, 413, 415)}},
    ("POST", "/v1/chunks/store"): {"summary": "Store a chunk's standalone KV under its position-independent chunk key "
                                              "(CacheBlend)",
                                   "requestBody": _body("ChunkStoreRequest"),
                                   "responses": {**_ok("StoreResult"), **_errors(400, 401, 403, 404, 413, 415, 507)}},
    ("POST", "/v1/blend"): {"summary": "The chunks' KV end to end from start_pos, K re-rotated; per-chunk hits "
                                       "(CacheBlend)",
                            "requestBody": _body("BlendRequest"),
                            "responses": {**_ok("BlendResult"), **_errors(400, 401, 404, 413, 415, 422)}},
}


def template_path(path: str) -> str:
    """`/v1/models/{model:.+}` -> `/v1/models/{model}`: the OpenAPI spelling of a route path."""
    return re.sub(r"\{(\w+):[^}]*\}", r"{\1}", path)


def served_routes(app: web.Application) -> list[tuple[str, str]]:
    """(method, path template) of every route the sidecar serves: the data plane's (every data
    route is a POST) and aiohttp's admin routes."""
    admin = [(route.method, route.resource.canonical if route.resource else "") for route in app.router.routes()]
    return [("POST", path) for path in DATA_ROUTES] + admin


def openapi_document(app: web.Application) -> dict[str, Any]:
    paths: dict[str, dict[str, Any]] = {}
    for method, path in served_routes(app):
        operation = OPERATIONS.get((method, path), {"summary": "undocumented", "responses": {}})
        if path.startswith("/v1/"):
            operation = {**operation, "security": [{"bearer": []}]}
        paths.setdefault(path, {})[method.lower()] = operation
    return {
        "openapi": "3.1.0",
        "info": {"title": "kvstore sidecar", "version": "1", "description":
                 "A tiered KV-cache store for LLM inference. Bodies are msgpack maps (application/msgpack); "
                 "JSON is accepted where the request says application/json (kv then base64)."},
        "paths": paths,
        "components": {"schemas": SCHEMAS, "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer"}}},
    }
