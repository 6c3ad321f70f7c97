"""`kvstore serve`: flags and KVSTORE_* map onto the configs; a real subprocess stores, fetches,
stops cleanly on SIGTERM and finds its pages on disk after a restart."""
from __future__ import annotations

import gc
import importlib.util
import json
import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from api_helpers import random_kv

from kvstore.api.client import KVStoreClient
from kvstore.api.server.config import ServerConfig
from kvstore.config import StoreConfig
from kvstore.api.server.serve import GC_YOUNG_THRESHOLD, ServeError, _settle_collector, check_bind
from kvstore import ModelSpec
from kvstore.cli import build_configs, build_parser, main

REPO = Path(__file__).resolve().parents[2]


def configs(argv: list[str], env: dict[str, str]):
    return build_configs(build_parser(env).parse_args(["serve", *argv]), env)


def test_flags_env_and_defaults_map_onto_the_configs():
    store, server = configs(["--cpu-bytes", "8GiB", "--port", "9000", "--no-promote-on-hit"],
                            {"KVSTORE_CPU_BYTES": "1GiB", "KVSTORE_DISK_BYTES": "2GiB", "KVSTORE_HOST": "127.0.0.2",
                             "KVSTORE_INSECURE": "yes", "KVSTORE_REDIS_TTL_S": "none"})
    assert store.cpu_bytes == 8 << 30  # flag beats env
    assert store.disk_bytes == 2 << 30  # env beats default
    assert store.promote_on_hit is False and store.redis_ttl_s is None
    assert store.policy == StoreConfig().policy  # default
    assert (server.host, server.port, server.insecure) == ("127.0.0.2", 9000, True)


def test_bad_values_name_the_flag_or_variable():
    with pytest.raises(ValueError, match="--cpu-bytes"):
        configs(["--cpu-bytes", "lots"], {})
    with pytest.raises(ValueError, match="KVSTORE_PORT"):
        configs([], {"KVSTORE_PORT": "http"})
    with pytest.raises(ValueError, match="policy"):
        configs(["--policy", "random"], {})
    assert main(["serve", "--durability", "sometimes"], {}) == 2
    with pytest.raises(ValueError, match="event_loop: must be one of auto, uvloop, asyncio"):
        configs(["--event-loop", "gevent"], {})


def test_non_loopback_bind_needs_auth_or_insecure():
    with pytest.raises(ServeError, match="--auth-file"):
        check_bind(ServerConfig(host="0.0.0.0"))
    check_bind(ServerConfig(host="0.0.0.0", insecure=True))
    check_bind(ServerConfig(host="0.0.0.0", auth_file="tokens.json"))
    check_bind(ServerConfig(host="localhost"))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _start(data_dir: Path, port: int) -> tuple[subprocess.Popen, str]:
    env = {**os.environ, "KVSTORE_DISK_BYTES": "64MiB", "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "serve", "--data-dir", str(data_dir), "--port", str(port),
         "--cpu-bytes", "16MiB", "--durability", "write-through"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    line = proc.stdout.readline()  # the startup line: printed once the socket accepts
    if not line:
        proc.kill()
        pytest.fail(f"kvstore serve did not start: {proc.stderr.read()}")
    return proc, line


def _stop(proc: subprocess.Popen) -> int:
    proc.send_signal(signal.SIGTERM)
    try:
        return proc.wait(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_serve_subprocess_roundtrip_sigterm_and_restart(tmp_path):
    spec = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
    kv, tokens = random_kv(spec, 10, seed=5), list(range(50, 60))
    port = _free_port()
    proc, line = _start(tmp_path / "data", port)
    assert f"http://127.0.0.1:{port}" in line and "cpu 16.0MiB" in line and "disk 64.0MiB" in line
    # "auto": uvloop when installed (api/server/event_loop.py)
    assert f"event loop: {'uvloop' if importlib.util.find_spec('uvloop') else 'asyncio'}" in line
    with KVStoreClient(f"http://127.0.0.1:{port}") as client:
        client.register_model("m", spec)
        assert client.store("m", tokens, kv).stored_tokens == 10
        assert torch.equal(client.fetch("m", tokens).kv, kv)
    assert _stop(proc) == 0, proc.stderr.read()
    assert any((tmp_path / "data").iterdir())

    proc, _ = _start(tmp_path / "data", port)
    try:
        with KVStoreClient(f"http://127.0.0.1:{port}") as client:
            client.register_model("m", spec)
            assert client.lookup("m", tokens).tiers == {"disk": 10}  # the CPU tier died with the process
            fetched = client.fetch("m", tokens)
            assert fetched.matched_tokens == 10 and torch.equal(fetched.kv, kv)
    finally:
        assert _stop(proc) == 0


def test_stats_command_prints_json(live_server, capsys):
    assert main(["stats", "--url", live_server.url], {}) == 0
    assert "tiers" in json.loads(capsys.readouterr().out)
    assert main(["stats", "--url", "http://127.0.0.1:1"], {}) == 1


def test_serving_hides_start_up_objects_from_the_collector_and_collects_young_ones_less_often():
    threshold = gc.get_threshold()
    try:
        _settle_collector()
        assert gc.get_freeze_count() > 10_000  # torch's modules, among others: no full collection scans them
        assert gc.get_threshold() == (GC_YOUNG_THRESHOLD, *threshold[1:])
    finally:
        gc.unfreeze()
        gc.set_threshold(*threshold)
