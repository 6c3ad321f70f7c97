"""Two real `kvstore serve` sidecars (separate data dirs) and one Redis, over HTTP: what one
stores the other fetches bit-exact and promotes; tenants hold across sidecars; Redis killed
mid-run leaves both answering from their local tiers (no 5xx), and sharing resumes once it is
back (docs/design.md §5)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Callable

import pytest
import torch
from kv_tensors import random_kv
from redis_helpers import RedisServer, free_port

from kvstore.api.client import KVStoreClient

REPO = Path(__file__).resolve().parents[2]
TOKENS = {"tok-alice": "alice", "tok-bob": "bob"}


class Sidecar:
    def __init__(self, data_dir: Path, redis_url: str, auth_file: Path):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        env = {**os.environ, "PYTHONPATH": str(REPO), "KVSTORE_REDIS_URL": redis_url}  # env maps onto the config too
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", "serve", "--data-dir", str(data_dir), "--port", str(self.port),
             "--cpu-bytes", "16MiB", "--disk-bytes", "64MiB", "--redis-timeout-s", "0.3",
             "--auth-file", str(auth_file)],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)

    def wait_ready(self) -> None:
        if not self.proc.stdout.readline():  # type: ignore[union-attr]  # the startup line
            self.proc.kill()
            pytest.fail(f"kvstore serve did not start: {self.proc.stderr.read()}")  # type: ignore[union-attr]

    def client(self, token: str) -> KVStoreClient:
        return KVStoreClient(self.url, token=token, timeout_s=10)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()


def eventually(check: Callable[[], bool], timeout_s: float = 10.0) -> bool:
    """Sharing is asynchronous (write-behind): poll until `check` holds."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if check():
            return True
        time.sleep(0.05)
    return check()


@pytest.fixture
def sidecars(tmp_path: Path, redis_server: RedisServer):
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps(TOKENS))
    pair = [Sidecar(tmp_path / name, redis_server.url, auth) for name in ("a", "b")]  # start both, then wait
    try:
        for sidecar in pair:
            sidecar.wait_ready()
        yield pair
    finally:
        for sidecar in pair:
            sidecar.stop()


def test_two_sidecars_share_through_redis_and_survive_its_death(sidecars, redis_server: RedisServer, spec):
    side_a, side_b = sidecars
    a, b, b_bob = side_a.client("tok-alice"), side_b.client("tok-alice"), side_b.client("tok-bob")
    for client in (a, b, b_bob):
        client.register_model("m", spec)
    tokens, kv = list(range(1000, 1022)), random_kv(spec, 22, seed=1)

    # Store through A, fetch through B bit-exact; B's lookup names Redis, then B's own tier.
    assert a.store("m", tokens, kv).stored_tokens == 22
    assert eventually(lambda: b.lookup("m", tokens).matched_tokens == 22)
    assert b.lookup("m", tokens).tiers == {"redis": 22}
    fetched = b.fetch("m", tokens)
    assert fetched.matched_tokens == 22 and torch.equal(fetched.kv, kv)
    assert b.lookup("m", tokens).tiers == {"cpu": 22}
    # Tenants hold across sidecars exactly as locally.
    assert b_bob.lookup("m", tokens).matched_tokens == 0 and b_bob.fetch("m", tokens).matched_tokens == 0

    # Redis dies: both keep answering from their local tiers; Redis pages are misses, no 5xx.
    redis_server.kill()
    t0 = time.monotonic()
    assert torch.equal(a.fetch("m", tokens).kv, kv) and torch.equal(b.fetch("m", tokens).kv, kv)
    new, new_kv = list(range(2000, 2008)), random_kv(spec, 8, seed=2)
    assert a.store("m", new, new_kv).stored_tokens == 8
    assert b.lookup("m", new).matched_tokens == 0 and b.fetch("m", new).matched_tokens == 0
    assert a.lookup("m", new).tiers == {"cpu": 8}
    assert time.monotonic() - t0 < 5.0
    assert a.healthz() and b.stats()["tiers"]["redis"]["up"] == 0 and a.stats()["tiers"]["redis"]["errors"] >= 1

    # Redis is back (empty): sharing resumes by itself.
    redis_server.start()
    later, later_kv = list(range(3000, 3012)), random_kv(spec, 12, seed=3)

    def shared_again() -> bool:
        a.store("m", later, later_kv)  # a store while the breaker is still open stays local: repeat
        if b.lookup("m", later).matched_tokens == 12:
            return True
        a.drop_model("m")
        a.register_model("m", spec)
        return False

    assert eventually(shared_again, timeout_s=15)
    fetched = b.fetch("m", later)
    assert fetched.matched_tokens == 12 and torch.equal(fetched.kv, later_kv)
    for client in (a, b, b_bob):
        client.close()
