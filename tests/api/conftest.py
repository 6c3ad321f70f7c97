"""Fixtures of the sidecar tests: the real store, the sidecar behind aiohttp's test client, a live
server in a background thread."""
from __future__ import annotations

from typing import Any, Iterator

import pytest
from aiohttp.test_utils import TestClient
from api_helpers import MAX_BODY_BYTES, LiveServer, call, sidecar_client

from kvstore.api.server.config import ServerConfig
from kvstore import KVStore, ModelSpec, StoreConfig


@pytest.fixture
def spec() -> ModelSpec:
    return ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)


@pytest.fixture
def store(tmp_path) -> Iterator[KVStore]:
    with KVStore(StoreConfig(data_dir=str(tmp_path / "data"), cpu_bytes=16 << 20, disk_bytes=32 << 20)) as s:
        yield s


@pytest.fixture
async def http(store: KVStore) -> Any:
    async with sidecar_client(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES)) as client:
        yield client


@pytest.fixture
async def http_model(http: TestClient, spec: ModelSpec) -> TestClient:
    status, _ = await call(http, "PUT", "/v1/models/m", spec.to_dict())
    assert status == 201
    return http


@pytest.fixture
def live_server(store: KVStore) -> Iterator[LiveServer]:
    server = LiveServer(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES))
    yield server
    server.close()
