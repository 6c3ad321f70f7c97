"""KVStoreClient and AsyncKVStoreClient: the KVStore surface over HTTP, same results, same errors."""
from __future__ import annotations

import asyncio
import socket

import numpy as np
import pytest
import torch
from api_helpers import random_kv

from kvstore.api.client import AsyncKVStoreClient, KVStoreClient
from kvstore import ModelSpec
from kvstore.backend import KVCacheBackend
from kvstore.errors import (BackendUnavailable, InvalidKV, InvalidRequest, InvalidStart, InvalidTokens, ModelConflict,
                            ModelNotFound)
from kvstore.results import FetchResult, LookupResult, StoreResult


def test_sync_client_mirrors_the_store(live_server, store, spec: ModelSpec):
    with KVStoreClient(live_server.url) as client:
        assert isinstance(client, KVCacheBackend)
        assert client.register_model("m", spec) == spec
        kv = random_kv(spec, 10)
        assert client.store("m", list(range(10)), kv) == StoreResult(stored_tokens=10, new_pages=3)
        lookup = client.lookup("m", torch.arange(12))
        assert lookup == store.lookup("m", list(range(12))) and isinstance(lookup, LookupResult)
        fetched = client.fetch("m", np.arange(10, dtype=np.int32), start=2)
        assert isinstance(fetched, FetchResult) and fetched.matched_tokens == 10
        assert fetched.kv.dtype == torch.float16 and torch.equal(fetched.kv, kv[:, :, 2:])
        assert client.get_spec("m") == spec
        assert client.stats()["tiers"]["cpu"]["pages"] == 3
        assert client.drop_model("m") == 3


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "tcp"])
def test_every_kv_dtype_comes_back_bit_exact_and_shaped(live_server, dtype: str, shared_memory: bool):
    spec = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype, page_size=4)
    kv = random_kv(spec, 10, seed=7)
    with KVStoreClient(live_server.url, shared_memory_bytes=None if shared_memory else 0) as client:
        client.register_model("m", spec)
        client.store("m", list(range(10)), kv)
        client.fetch("m", list(range(10)))  # teaches the client the model's bytes per token
        fetched = client.fetch("m", list(range(10)), start=3)
        assert fetched.kv.dtype == kv.dtype and fetched.kv.shape == kv[:, :, 3:].shape
        assert torch.equal(fetched.kv.view(torch.uint8), kv[:, :, 3:].contiguous().view(torch.uint8))
        arena = client._arena
        assert (arena is not None) == shared_memory
        if arena is not None:  # the tensor views shared memory, whose region is held until the tensor is gone
            base = arena.view(0, 1).ctypes.data
            assert base <= fetched.kv.data_ptr() < base + arena.nbytes
            held = arena.free_bytes()
            kept = fetched.kv[0]  # a view of the tensor keeps the region too
            del fetched
            assert arena.free_bytes() == held and torch.equal(kept, kv[0, :, 3:])
            del kept
            assert arena.free_bytes() > held


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "tcp"])
def test_fetch_into_a_reused_buffer_receives_the_kv_there_over_tcp(live_server, shared_memory: bool):
    # Over TCP a large answer lands in the caller's buffer (no fresh memory to fault in); through
    # shared memory it lands in the arena. Either way the KV is the stored KV, every time.
    spec = ModelSpec(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float32", page_size=16)
    kv = random_kv(spec, 64, seed=11)  # 512 KiB: a large body
    with KVStoreClient(live_server.url, shared_memory_bytes=None if shared_memory else 0) as client:
        client.register_model("m", spec)
        client.store("m", list(range(64)), kv)
        client.fetch("m", list(range(64)))  # teaches the client the model's bytes per token (shared memory)
        into = torch.zeros(kv.numel() * 4 + 4096, dtype=torch.uint8)
        lo, hi = into.data_ptr(), into.data_ptr() + into.numel()
        for start in (0, 16, 0):
            fetched = client.fetch("m", list(range(64)), start=start, into=into)
            assert fetched.matched_tokens == 64 and torch.equal(fetched.kv, kv[:, :, start:])
            assert (lo <= fetched.kv.data_ptr() < hi) == (not shared_memory)
        too_small = torch.zeros(kv.numel() * 4 // 2, dtype=torch.uint8)  # a fresh buffer instead
        fetched = client.fetch("m", list(range(64)), into=too_small)
        assert torch.equal(fetched.kv, kv) and not too_small.data_ptr() <= fetched.kv.data_ptr() < \
            too_small.data_ptr() + too_small.numel()
        assert not too_small.any()
        with pytest.raises(InvalidRequest, match="into: expected a flat contiguous uint8 tensor"):
            client.fetch("m", list(range(64)), into=torch.zeros(8, dtype=torch.float32))
        with pytest.raises(InvalidRequest, match="into"):
            client.fetch("m", list(range(64)), into=bytearray(1 << 20))


def test_sync_client_extends_with_start_and_reuses_its_connection(live_server, spec: ModelSpec):
    with KVStoreClient(live_server.url) as client:
        client.register_model("m", spec)
        kv = random_kv(spec, 8, seed=3)
        client.store("m", list(range(4)), kv[:, :, :4])
        client.store("m", list(range(8)), kv[:, :, 4:].numpy(), start=4)
        for _ in range(20):
            assert torch.equal(client.fetch("m", list(range(8))).kv, kv)
        assert len(client._idle) == 1  # one connection served every call


def test_sync_client_raises_the_store_errors(live_server, spec: ModelSpec):
    with KVStoreClient(live_server.url) as client:
        with pytest.raises(ModelNotFound, match="nope"):
            client.lookup("nope", [1])
        client.register_model("m", spec)
        with pytest.raises(ModelConflict):
            client.register_model("m", ModelSpec(num_layers=1, num_kv_heads=2, head_dim=8, page_size=4))
        with pytest.raises(InvalidKV, match="kv"):
            client.store("m", [1, 2, 3], random_kv(spec, 2))
        with pytest.raises(InvalidKV, match="dtype"):
            client.store("m", [1, 2], random_kv(spec, 2).float())
        with pytest.raises(InvalidStart, match="start"):
            client.fetch("m", [1, 2], start=5)
        with pytest.raises(InvalidTokens, match="tokens"):
            client.lookup("m", [1.5, 2.0])
        with pytest.raises(ValueError, match="tenant"):
            client.lookup("m", [1], tenant="alice")
        assert client.lookup("m", [1, 2, 3]).matched_tokens == 0  # nothing partly stored


def test_unreachable_server_is_backend_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    with KVStoreClient(f"http://127.0.0.1:{port}", timeout_s=2) as client:
        with pytest.raises(BackendUnavailable, match=str(port)):
            client.stats()


def test_timeout_is_backend_unavailable():
    with socket.socket() as listener:  # accepts, never answers
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        url = f"http://127.0.0.1:{listener.getsockname()[1]}"
        with KVStoreClient(url, timeout_s=0.3) as client:
            with pytest.raises(BackendUnavailable, match="timed out"):
                client.stats()


async def test_async_client_mirrors_the_store(live_server, spec: ModelSpec):
    async with AsyncKVStoreClient(live_server.url) as client:
        assert await client.register_model("m", spec) == spec
        kv = random_kv(spec, 6, seed=1)
        assert (await client.store("m", list(range(6)), kv)).stored_tokens == 6
        assert (await client.lookup("m", list(range(6)))).matched_tokens == 6
        fetched = await client.fetch("m", list(range(6)), start=1)
        assert torch.equal(fetched.kv, kv[:, :, 1:])
        with pytest.raises(ModelNotFound):
            await client.fetch("nope", [1])
        assert (await client.stats())["tiers"]["cpu"]["pages"] == 2
        assert await client.drop_model("m") == 2


async def test_async_client_unreachable_is_backend_unavailable():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    async with AsyncKVStoreClient(f"http://127.0.0.1:{port}", timeout_s=2) as client:
        with pytest.raises(BackendUnavailable):
            await client.stats()


async def test_async_client_runs_calls_concurrently_through_shared_memory(live_server, spec: ModelSpec):
    # The sync client's path on a thread pool: 8 concurrent stores and fetches each get their own
    # KV back, and on the sidecar's host the fetched tensors view the client's shared memory.
    async with AsyncKVStoreClient(live_server.url, max_connections=4) as client:
        await client.register_model("m", spec)
        kvs = [random_kv(spec, 8, seed=i) for i in range(8)]
        prompts = [list(range(100 * i, 100 * i + 8)) for i in range(8)]
        stored = await asyncio.gather(*[client.store("m", p, kv) for p, kv in zip(prompts, kvs)])
        assert all(result.stored_tokens == 8 for result in stored)
        await client.fetch("m", prompts[0])  # teaches the client the model's bytes per token
        fetched = await asyncio.gather(*[client.fetch("m", p) for p in prompts])
        assert all(torch.equal(got.kv, kv) for got, kv in zip(fetched, kvs))
        arena = client._client._arena
        assert arena is not None
        base = arena.view(0, 1).ctypes.data
        assert all(base <= got.kv.data_ptr() < base + arena.nbytes for got in fetched)
        assert await client.healthz()


def test_async_client_max_connections_is_validated():
    with pytest.raises(ValueError, match="max_connections"):
        AsyncKVStoreClient("http://127.0.0.1:1", max_connections=0)
