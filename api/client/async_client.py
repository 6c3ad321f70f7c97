"""`AsyncKVStoreClient`: the sidecar's client for asyncio, the sync client on a thread pool.

The KV takes the sync client's path (api/client/sync_client.py): shared memory with a sidecar on
the same host, scatter-gather sends, answers read into one buffer.
"""
from __future__ import annotations

import asyncio
import functools
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Sequence, TypeVar

from kvstore.api.client.sync_client import DEFAULT_URL, KVStoreClient
from kvstore.config import ModelSpec
from kvstore.results import AuditReport, BlendResult, FetchResult, LookupResult, StoreResult

T = TypeVar("T")


class AsyncKVStoreClient:
    """The asyncio twin of `KVStoreClient`: that same client, its blocking calls run on a thread
    pool of `max_connections` threads, so the event loop never waits on the sidecar and the KV
    takes the same path (shared memory on the sidecar's host, scatter-gather sends, answers read
    into one buffer). Why not aiohttp's client: it joins a store's parts into one bytes object
    and reads answers through its stream reader, several times slower per request than this
    client against the same sidecar (docs/performance.md).

    A cancelled call's thread finishes its request (every route is idempotent); `close()` waits
    for calls in flight, then closes the connections and the arena."""

    def __init__(self, url: str = DEFAULT_URL, *, token: str | None = None, timeout_s: float = 30.0,
                 max_connections: int = 64, socket_buffer_bytes: int = 4 << 20,
                 shared_memory_bytes: int | None = None):
        if isinstance(max_connections, bool) or not isinstance(max_connections, int) or max_connections < 1:
            raise ValueError(f"max_connections: expected an int >= 1, got {max_connections!r}")
        self._client = KVStoreClient(url, token=token, timeout_s=timeout_s, socket_buffer_bytes=socket_buffer_bytes,
                                     shared_memory_bytes=shared_memory_bytes)
        self.url = self._client.url
        self._pool = ThreadPoolExecutor(max_connections, thread_name_prefix="kvstore-client")

    async def _run(self, method: Callable[..., T], *args: Any, **kwargs: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(method, *args, **kwargs))

    async def register_model(self, model: str, spec: ModelSpec, *, tenant: str | None = None) -> ModelSpec:
        return await self._run(self._client.register_model, model, spec, tenant=tenant)

    async def get_spec(self, model: str, *, tenant: str | None = None) -> ModelSpec:
        return await self._run(self._client.get_spec, model, tenant=tenant)

    async def drop_model(self, model: str, *, tenant: str | None = None) -> int:
        return await self._run(self._client.drop_model, model, tenant=tenant)

    async def lookup(self, model: str, tokens: Sequence[int], *, tenant: str | None = None,
                     salt: str | None = None) -> LookupResult:
        return await self._run(self._client.lookup, model, tokens, tenant=tenant, salt=salt)

    async def fetch(self, model: str, tokens: Sequence[int], *, start: int = 0, tenant: str | None = None,
                    salt: str | None = None, device: str = "cpu", into: Any = None, heads: Any = None,
                    layers: Any = None) -> FetchResult:
        return await self._run(self._client.fetch, model, tokens, start=start, tenant=tenant, salt=salt, device=device,
                               into=into, heads=heads, layers=layers)

    async def store(self, model: str, tokens: Sequence[int], kv: Any, *, start: int = 0,
                    tenant: str | None = None, salt: str | None = None, heads: Any = None,
                    layers: Any = None) -> StoreResult:
        return await self._run(self._client.store, model, tokens, kv, start=start, tenant=tenant, salt=salt,
                               heads=heads, layers=layers)

    async def store_chunk(self, model: str, tokens: Sequence[int], kv: Any, *,
                          tenant: str | None = None, salt: str | None = None) -> StoreResult:
        return await self._run(self._client.store_chunk, model, tokens, kv, tenant=tenant, salt=salt)

    async def blend(self, model: str, chunks: Sequence[Sequence[int]], *, start_pos: int = 0,
                    tenant: str | None = None, salt: str | None = None, device: str = "cpu") -> BlendResult:
        return await self._run(self._client.blend, model, chunks, start_pos=start_pos, tenant=tenant, salt=salt,
                               device=device)

    async def report_audit(self, model: str, tokens: Sequence[int], *, passed: bool, tier: str | None = None,
                           layer: int | None = None, tenant: str | None = None, salt: str | None = None,
                           chunk: bool = False) -> AuditReport:
        return await self._run(self._client.report_audit, model, tokens, passed=passed, tier=tier, layer=layer,
                               tenant=tenant, salt=salt, chunk=chunk)

    async def stats(self) -> dict[str, Any]:
        return await self._run(self._client.stats)

    async def healthz(self) -> bool:
        return await self._run(self._client.healthz)

    async def close(self) -> None:
        # Off the loop: shutting the pool down waits for the calls still running.
        await asyncio.get_running_loop().run_in_executor(None, self._pool.shutdown)
        self._client.close()

    async def __aenter__(self) -> "AsyncKVStoreClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()
