"""`KVStoreClient`: the sidecar's Python client, sync, on its own HTTP/1.1 connections
(`AsyncKVStoreClient`, api/client/async_client.py, runs it on a thread pool for asyncio). Same
methods and result types as the in-process `KVStore`, so the decode loop takes either through
`KVCacheBackend`; errors are the same `KVStoreError` subclasses; a server that cannot be reached
(refused, reset, timed out) is `BackendUnavailable`.

The sync client keeps persistent connections (a small pool, so one client is thread-safe),
sends a request's head, fields and the tensor's own memory in one scatter-gather syscall and
reads a fetch's answer into one preallocated buffer that the returned tensor views (api/client/http1.py).
With a sidecar on the same host the KV itself skips the socket: the client registers a
shared-memory arena on each connection and stores/fetches name regions of it (one copy each
way instead of two kernel copies and a user-space one; api/client/arena.py). The tenant is the
server's business (bearer token), not a per-call argument.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Sequence
from urllib.parse import urlsplit

import numpy as np
import torch

from kvstore.api.client import codec
from kvstore.api.client.arena import ClientArena
from kvstore.api.client.http1 import Connection, ProtocolError
from kvstore.api.protocol import (BLEND_PATH, FETCH_PATH, LOOKUP_PATH, SHM_PATH, STORE_CHUNK_PATH, STORE_PATH,
                                   is_loopback)
from kvstore.config import ModelSpec
from kvstore.copy_threads import copy_all
from kvstore.errors import BackendUnavailable, KVStoreError, SharedMemoryRefused
from kvstore.page_slice import PageSlice
from kvstore.results import AuditReport, BlendResult, FetchResult, LookupResult, StoreResult
from kvstore.validation import check_into

DEFAULT_URL = "http://127.0.0.1:8100"
DEFAULT_SHARED_MEMORY_BYTES = 256 << 20  # for a client of a sidecar on its own host

log = logging.getLogger("kvstore.client")


class _Forks:
    """How many forks deep this process is: a child's count differs from its parent's."""

    def __init__(self) -> None:
        self.generation = 0
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        self.generation += 1


_forks = _Forks()


class KVStoreClient:
    """`shared_memory_bytes`: size of the client's shared-memory arena (api/client/arena.py),
    through which a sidecar on the same host moves KV instead of the socket. None: 256 MiB when
    the URL's host is a loopback address, else 0 (off). It is switched off, with one warning, if
    the sidecar refuses it (another host or user, or `--no-shared-memory`)."""

    def __init__(self, url: str = DEFAULT_URL, *, token: str | None = None, timeout_s: float = 30.0,
                 socket_buffer_bytes: int = 4 << 20, shared_memory_bytes: int | None = None):
        parts = urlsplit(url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"url: expected http://host:port, got {url!r}")
        if shared_memory_bytes is None:
            shared_memory_bytes = DEFAULT_SHARED_MEMORY_BYTES if is_loopback(parts.hostname) else 0
        if isinstance(shared_memory_bytes, bool) or not isinstance(shared_memory_bytes, int) or shared_memory_bytes < 0:
            raise ValueError(f"shared_memory_bytes: expected an int >= 0 (0: off), got {shared_memory_bytes!r}")
        self._shm_bytes = shared_memory_bytes
        self._arena: ClientArena | None = None
        self._arena_generation = _forks.generation
        # Learned from answers, per model and slice of the pages: sizes fetch regions.
        self._bytes_per_token: dict[tuple[str, str], int] = {}
        self.url = url.rstrip("/")
        self._host, self._port = parts.hostname, parts.port or 80
        self._timeout_s = timeout_s
        self._socket_buffer_bytes = socket_buffer_bytes
        headers = dict(codec.HEADERS, Host=f"{self._host}:{self._port}",
                       **({"Authorization": f"Bearer {token}"} if token else {}))
        self._head_lines = "".join(f"{k}: {v}\r\n" for k, v in headers.items())
        self._idle: list[Connection] = []
        self._lock = threading.Lock()

    # ---- the KVStore surface ----------------------------------------------------------------

    def register_model(self, model: str, spec: ModelSpec, *, tenant: str | None = None) -> ModelSpec:
        codec.check_tenant(tenant)
        return codec.spec_result(self._call("PUT", codec.model_path(model), [codec.spec_body(spec)]))

    def get_spec(self, model: str, *, tenant: str | None = None) -> ModelSpec:
        codec.check_tenant(tenant)
        return codec.spec_result(self._call("GET", codec.model_path(model)))

    def drop_model(self, model: str, *, tenant: str | None = None) -> int:
        codec.check_tenant(tenant)
        return self._call("DELETE", codec.model_path(model))["dropped_pages"]

    def lookup(self, model: str, tokens: Sequence[int], *, tenant: str | None = None,
               salt: str | None = None) -> LookupResult:
        codec.check_tenant(tenant)
        return codec.lookup_result(self._call("POST", LOOKUP_PATH, [codec.tokens_body(model, tokens, salt=salt)]))

    def fetch(self, model: str, tokens: Sequence[int], *, start: int = 0, tenant: str | None = None,
              salt: str | None = None, device: str = "cpu", into: Any = None, heads: Any = None,
              layers: Any = None) -> FetchResult:
        """`into`, as `KVStore.fetch`'s: a flat uint8 CPU tensor that an answer coming over the
        socket is received into when it holds the whole answer (its KV and a few hundred bytes of
        fields; `kv` then views part of it), instead of fresh memory, whose page faults a
        reused buffer does not pay. Through shared memory `kv` views the client's arena, where
        the sidecar wrote it, and `into` is not used. `heads` / `layers`: as `KVStore.fetch`'s."""
        codec.check_tenant(tenant)
        checked_into = check_into(into, torch.device("cpu"))
        receive = None if checked_into is None else checked_into.numpy()
        part = PageSlice.wire_fields(layers=layers, heads=heads)
        sized_by = (model, repr(part))
        arena, per_token = self._shared_memory(), self._bytes_per_token.get(sized_by)
        sized = per_token and isinstance(start, int) and hasattr(tokens, "__len__")
        wanted = (len(tokens) - start) * per_token if per_token and sized else 0
        offset = arena.allocate(wanted) if arena is not None and wanted > 0 else None
        if offset is not None:  # the answer is written into our shared memory (api/server/shared_memory.py)
            assert arena is not None
            try:
                body = codec.tokens_body(model, tokens, start, shm=(offset, wanted), salt=salt, part=part)
            except BaseException:
                arena.release(offset, wanted)
                raise
            try:
                obj = self._shared_memory_call(FETCH_PATH, [body], arena, offset, wanted)
            except SharedMemoryRefused as exc:
                self._shared_memory_off(exc)
            else:
                placed = obj.get("shm")
                if placed is None:  # it did not fit (the model changed?): the KV came in the body
                    arena.release(offset, wanted)
                    return self._fetch_result(sized_by, obj, device)
                if placed.get("offset") != offset or not 0 <= placed.get("nbytes", -1) <= wanted:
                    arena.release(offset, wanted)
                    raise BackendUnavailable(f"{self.url}: fetch answered shm {placed!r}, "
                                             f"asked for ({offset}, {wanted})")
                raw = arena.adopt(offset, wanted, placed["nbytes"], lambda array: codec.kv_array(array, obj))
                return self._fetch_result(sized_by, obj, device, raw=raw)
        answer = self._call("POST", FETCH_PATH, [codec.tokens_body(model, tokens, start, salt=salt, part=part)],
                            into=receive)
        return self._fetch_result(sized_by, answer, device)

    def store(self, model: str, tokens: Sequence[int], kv: Any, *, start: int = 0,
              tenant: str | None = None, salt: str | None = None, heads: Any = None,
              layers: Any = None) -> StoreResult:
        """`heads` / `layers`: `kv` is that part of the pages, as with `KVStore.store`."""
        codec.check_tenant(tenant)
        part = PageSlice.wire_fields(layers=layers, heads=heads)
        return self._store(STORE_PATH, model, tokens, kv, start, salt, part)

    def store_chunk(self, model: str, tokens: Sequence[int], kv: Any, *, tenant: str | None = None,
                    salt: str | None = None) -> StoreResult:
        codec.check_tenant(tenant)
        return self._store(STORE_CHUNK_PATH, model, tokens, kv, 0, salt)

    def blend(self, model: str, chunks: Sequence[Sequence[int]], *, start_pos: int = 0,
              tenant: str | None = None, salt: str | None = None, device: str = "cpu") -> BlendResult:
        codec.check_tenant(tenant)
        body = codec.blend_body(model, chunks, start_pos, salt)
        return codec.blend_result(self._call("POST", BLEND_PATH, [body]), device)

    def report_audit(self, model: str, tokens: Sequence[int], *, passed: bool, tier: str | None = None,
                     layer: int | None = None, tenant: str | None = None, salt: str | None = None,
                     chunk: bool = False) -> AuditReport:
        codec.check_tenant(tenant)
        fields = codec.with_salt({"model": model, "tokens": codec.tokens_bin(tokens), "passed": passed,
                                  "tier": tier, "layer": layer}, salt)
        if chunk is not False:  # a prefix's report stays what sidecars without chunk audits read
            fields["chunk"] = chunk
        answer = self._call("POST", "/v1/audit", [codec.small_body(fields)])
        return AuditReport(int(answer["dropped_pages"]), int(answer["kept_pages"]))

    def stats(self) -> dict[str, Any]:
        return self._call("GET", "/v1/stats")

    def healthz(self) -> bool:
        return self._call("GET", "/healthz").get("status") == "ok"

    def close(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            arena, self._arena = self._arena, None
        for conn in idle:
            conn.close()
        if arena is not None:
            arena.close()

    def __enter__(self) -> "KVStoreClient":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- shared memory ----------------------------------------------------------------------

    def _store(self, path: str, model: str, tokens: Sequence[int], kv: Any, start: int,
               salt: str | None, part: dict[str, Any] | None = None) -> StoreResult:
        arena = self._shared_memory()
        if arena is not None:
            raw, dtype = codec.kv_bytes(kv)
            offset = arena.allocate(raw.nbytes) if raw.nbytes else None
            if offset is not None:  # one copy into our shared memory; the sidecar copies it into its tier
                try:
                    copy_all([(arena.view(offset, raw.nbytes), np.frombuffer(raw, dtype=np.uint8))])
                    body = codec.store_shm_body(model, tokens, dtype, start, (offset, raw.nbytes), salt, part)
                except BaseException:
                    arena.release(offset, raw.nbytes)
                    raise
                try:
                    obj = self._shared_memory_call(path, [body], arena, offset, raw.nbytes)
                except SharedMemoryRefused as exc:
                    self._shared_memory_off(exc)
                else:
                    arena.release(offset, raw.nbytes)
                    return codec.store_result(obj)
        return codec.store_result(self._call("POST", path, codec.store_parts(model, tokens, kv, start, salt, part)))

    def _shared_memory_call(self, path: str, parts: codec.Parts, arena: ClientArena, offset: int, nbytes: int) -> Any:
        """POST a request naming the region [offset, offset + nbytes). If the sidecar answered
        with an error the region is released; if the exchange broke (timeout, reset) it is not:
        the sidecar may still be copying into or out of it, and reusing it could hand a later
        call torn KV. A broken exchange thus costs its region for the arena's lifetime."""
        try:
            return self._call("POST", path, parts)
        except BackendUnavailable:
            raise
        except KVStoreError:
            arena.release(offset, nbytes)
            raise

    def _fetch_result(self, sized_by: tuple[str, str], obj: dict[str, Any], device: str,
                      raw: Any = None) -> FetchResult:
        per_token = codec.bytes_per_token(obj)
        if per_token:
            self._bytes_per_token[sized_by] = per_token
        return codec.fetch_result(obj, device, raw)

    def _shared_memory(self) -> ClientArena | None:
        """The arena, made on first use; None when off. A forked child never uses its parent's
        arena (both would hand out the same regions); a fork is told by `_forks`, not by
        comparing os.getpid(), a syscall on every call."""
        if not self._shm_bytes or _forks.generation != self._arena_generation:
            return None
        if self._arena is None:
            with self._lock:
                if self._arena is None:
                    try:
                        self._arena = ClientArena(self._shm_bytes)
                    except OSError as exc:
                        self._shm_bytes = 0
                        log.warning("kvstore client: no shared memory (%s); KV goes through the socket", exc)
                        return None
        return self._arena

    def _shared_memory_off(self, reason: Exception) -> None:
        if self._shm_bytes:
            self._shm_bytes = 0
            log.warning("kvstore client: %s refused shared memory (%s); KV goes through the socket", self.url, reason)

    def _register(self, conn: Connection) -> None:
        """Register the arena on a new connection (POST /v1/shm); a refusal switches it off."""
        arena = self._shared_memory()
        if arena is None:
            return
        body = codec.small_body(arena.registration())
        try:
            codec.decode(*conn.request(self._head("POST", SHM_PATH, len(body)), [body]))
        except KVStoreError as exc:  # refused, or a sidecar without /v1/shm (404)
            self._shared_memory_off(exc)

    # ---- transport --------------------------------------------------------------------------

    def _head(self, method: str, path: str, length: int) -> bytes:
        return f"{method} {path} HTTP/1.1\r\n{self._head_lines}Content-Length: {length}\r\n\r\n".encode()

    def _call(self, method: str, path: str, parts: codec.Parts | None = None, into: np.ndarray | None = None) -> Any:
        parts = parts or []
        body_bytes = sum(memoryview(p).nbytes for p in parts)
        head = self._head(method, path, body_bytes)
        conn = None
        try:
            conn = self._take()
            try:
                status, ctype, body = conn.request(head, parts, body_bytes=body_bytes, into=into)
            except (ConnectionError, ProtocolError):
                # A kept-alive connection the server has since closed: retry once on a fresh one
                # (every route is idempotent: storing the same pages again changes nothing).
                conn.close()
                if not conn.served:
                    raise
                conn = self._new()
                status, ctype, body = conn.request(head, parts, body_bytes=body_bytes, into=into)
        except OSError as exc:  # refused, reset, timed out, garbled
            if conn is not None:
                conn.close()
            raise BackendUnavailable(f"{self.url}: {method} {path}: {type(exc).__name__}: {exc}") from exc
        self._give(conn)
        return codec.decode(status, ctype, body)

    def _take(self) -> Connection:
        with self._lock:
            if self._idle:
                return self._idle.pop()
        return self._new()

    def _new(self) -> Connection:
        conn = Connection(self._host, self._port, timeout_s=self._timeout_s,
                          socket_buffer_bytes=self._socket_buffer_bytes)
        self._register(conn)
        return conn

    def _give(self, conn: Connection) -> None:
        if conn.closed:
            return
        with self._lock:
            self._idle.append(conn)
