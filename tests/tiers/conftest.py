"""Fixtures of the Redis tier's tests: a redis-server per test, and stores pointed at it."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest
from redis_helpers import RedisServer

from kvstore import KVStore, ModelSpec, StoreConfig


@pytest.fixture
def spec() -> ModelSpec:
    return ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture
def make_sidecar_store(tmp_path: Path, redis_server: RedisServer) -> Iterator[Callable[..., KVStore]]:
    """Stores as separate sidecars would run them: each its own data dir, one Redis."""
    stores: list[KVStore] = []

    def make(name: str, **overrides) -> KVStore:
        fields = {"data_dir": str(tmp_path / name), "cpu_bytes": 1 << 20, "disk_bytes": 8 << 20,
                  "redis_url": redis_server.url, "redis_timeout_s": 0.5}
        fields.update(overrides)
        store = KVStore(StoreConfig(**fields))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()
