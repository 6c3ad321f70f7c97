"""Fixtures of the Redis tier's tests: a redis-server per test, and stores pointed at it."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import pytest
from redis_helpers import RedisServer

from kvstore import KVStore, ModelSpec


@pytest.fixture
def spec() -> ModelSpec:
    return ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)


@pytest.fixture
def redis_server(tmp_path: Path) -> Iterator[RedisServer]:
    server = RedisServer(tmp_path / "redis")
    yield server
    server.stop()


@pytest.fixture
def make_sidecar_store(tmp_path: Path, redis_server: RedisServer,
                       make_store: Callable[..., KVStore]) -> Callable[..., KVStore]:
    """Stores as separate sidecars would run them: each its own data dir, one Redis. (After
    `redis_server` in the arguments: the stores close before the server stops.)"""

    def make(name: str, **overrides) -> KVStore:
        return make_store(**{"data_dir": str(tmp_path / name), "redis_url": redis_server.url, "redis_timeout_s": 0.5,
                             **overrides})

    return make
