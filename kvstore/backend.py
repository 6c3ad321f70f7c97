"""The one protocol the decode loop talks to: implemented by the in-process `KVStore` and by
`KVStoreClient` (the sidecar), so an engine switches between them without other changes."""
from __future__ import annotations

from typing import Any, Protocol, Sequence, runtime_checkable

from kvstore.config import ModelSpec
from kvstore.results import AuditReport, BlendResult, FetchResult, LookupResult, StoreResult


@runtime_checkable
class KVCacheBackend(Protocol):
    def register_model(self, model: str, spec: ModelSpec, *, tenant: str | None = None) -> ModelSpec: ...

    def lookup(self, model: str, tokens: Sequence[int], *, tenant: str | None = None) -> LookupResult: ...

    def fetch(self, model: str, tokens: Sequence[int], *, start: int = 0, tenant: str | None = None,
              device: str = "cpu") -> FetchResult: ...

    def store(self, model: str, tokens: Sequence[int], kv: Any, *, start: int = 0,
              tenant: str | None = None) -> StoreResult: ...

    def store_chunk(self, model: str, tokens: Sequence[int], kv: Any, *, tenant: str | None = None) -> StoreResult: ...

    def blend(self, model: str, chunks: Sequence[Sequence[int]], *, start_pos: int = 0,
              tenant: str | None = None) -> BlendResult: ...

    def report_audit(self, model: str, tokens: Sequence[int], *, passed: bool, tier: str | None = None,
                     layer: int | None = None, tenant: str | None = None, chunk: bool = False) -> AuditReport: ...
