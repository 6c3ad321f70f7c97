"""Redis Cluster through `redis+cluster://`: pages of one prompt hash to slots on different
nodes, pipelined reads, probes and writes are routed per key, and two stores share pages."""
from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Iterator

import pytest
import torch
from redis_helpers import REDIS_CLI, RedisServer

from kvstore import KVStore, ModelSpec, StoreConfig

NODES = 3


@pytest.fixture
def cluster(tmp_path: Path) -> Iterator[list[RedisServer]]:
    if REDIS_CLI is None:
        pytest.skip("redis-cli is not installed (it comes with redis-server's package)")
    nodes: list[RedisServer] = []
    try:
        for i in range(NODES):
            nodes.append(RedisServer(tmp_path / f"node{i}", None, "--cluster-enabled", "yes",
                                     "--cluster-config-file", str(tmp_path / f"node{i}" / "nodes.conf")))
        subprocess.run([REDIS_CLI, "--cluster", "create", *[f"127.0.0.1:{n.port}" for n in nodes],
                        "--cluster-replicas", "0", "--cluster-yes"], check=True, capture_output=True, timeout=30)
        deadline = time.monotonic() + 15
        while not all(n.client().cluster("info").get("cluster_state") == "ok" for n in nodes):
            assert time.monotonic() < deadline, "the cluster did not converge"
            time.sleep(0.1)
        yield nodes
    finally:
        for node in nodes:
            node.stop()


def test_two_stores_share_pages_through_redis_cluster(cluster: list[RedisServer], tmp_path: Path, spec: ModelSpec):
    url = f"redis+cluster://127.0.0.1:{cluster[0].port}"
    stores = [KVStore(StoreConfig(data_dir=None, cpu_bytes=1 << 20, disk_bytes=0, redis_url=url)) for _ in range(2)]
    try:
        a, b = stores
        for store in stores:
            store.register_model("m", spec)
        tokens = list(range(64))
        # (L, 2, T, H, D)
        kv = torch.randn(spec.kv_shape(64), generator=torch.Generator().manual_seed(0)).to(torch.float16)
        assert a.store("m", tokens, kv).new_pages == 16
        assert a.flush(10)
        assert sum(n.client().dbsize() for n in cluster) == 16
        assert sum(1 for n in cluster if n.client().dbsize()) > 1  # spread over the nodes
        assert b.lookup("m", tokens).tiers == {"redis": 64}
        fetched = b.fetch("m", tokens)
        assert fetched.matched_tokens == 64 and torch.equal(fetched.kv, kv)
        assert b.lookup("m", tokens).tiers == {"cpu": 64}
    finally:
        for store in stores:
            store.close()


def test_cluster_down_at_start_is_a_miss_not_an_error(tmp_path: Path, spec: ModelSpec):
    server = RedisServer(tmp_path / "gone")
    server.kill()
    with KVStore(StoreConfig(data_dir=None, cpu_bytes=1 << 20, disk_bytes=0, redis_timeout_s=0.2,
                             redis_url=f"redis+cluster://127.0.0.1:{server.port}")) as store:
        store.register_model("m", spec)
        kv = torch.zeros(spec.kv_shape(8), dtype=torch.float16)  # (L, 2, T, H, D)
        t0 = time.monotonic()
        assert store.lookup("m", list(range(8))).matched_tokens == 0
        assert store.store("m", list(range(8)), kv).stored_tokens == 8  # local tiers keep working
        assert store.fetch("m", list(range(8))).matched_tokens == 8
        assert time.monotonic() - t0 < 2.0
        assert store.stats()["tiers"]["redis"]["up"] == 0
