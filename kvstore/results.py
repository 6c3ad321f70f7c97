"""Result types of the store API. The in-process `KVStore`, `KVStoreClient` and
`AsyncKVStoreClient` all return exactly these."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class StoreResult:
    stored_tokens: int  # tokens of the sequence now held by the store (a prefix of it)
    new_pages: int  # pages this call wrote


@dataclass(frozen=True)
class LookupResult:
    matched_tokens: int  # leading tokens whose KV the store holds
    tiers: dict[str, int] = field(default_factory=dict)  # tier -> matched tokens served by it


@dataclass(frozen=True)
class FetchResult:
    matched_tokens: int
    kv: Any  # torch.Tensor (L, 2, matched_tokens - start, H, D), or None when nothing matched


@dataclass(frozen=True)
class AuditReport:
    dropped_pages: int  # pages a failed audit removed from every tier (0 for a pass)
    kept_pages: int  # pages of the failed path left in place because a request held them pinned


@dataclass(frozen=True)
class BlendResult:
    hits: list[bool]  # per chunk
    kv: Any  # torch.Tensor (L, 2, sum(chunk lengths), H, D); missed chunks are zeros
    positions: list[tuple[int, int]]  # per chunk: [start, end) positions in the new prompt
