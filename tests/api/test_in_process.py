"""`InProcessSidecar` (api/server/in_process.py): the real app on a loopback port, served from a
thread of this process, and the store it serves, reachable in-process through `store` (how the
vLLM connector's scheduler side reads that store's KV events)."""
from __future__ import annotations

import torch
from kv_tensors import random_kv

from kvstore import KVStore, ModelSpec, StoreConfig
from kvstore.api.client import KVStoreClient
from kvstore.api.server.in_process import InProcessSidecar

SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)


def test_the_served_store_is_the_one_its_clients_write_to() -> None:
    sidecar = InProcessSidecar(StoreConfig(data_dir=None, cpu_bytes=1 << 20, disk_bytes=0))
    assert sidecar.store is None  # nothing is served before it is entered
    tokens = list(range(1, 9))
    kv = random_kv(SPEC, len(tokens))
    with sidecar as url, KVStoreClient(url) as client:
        assert url.startswith("http://127.0.0.1:")
        client.register_model("m", SPEC)
        assert client.store("m", tokens, kv).stored_tokens == 8
        store = sidecar.store
        assert isinstance(store, KVStore)
        assert store.lookup("m", tokens).matched_tokens == 8  # the client's pages, seen in-process
        fetched = store.fetch("m", tokens)
        assert fetched.kv is not None and torch.equal(fetched.kv, kv)
