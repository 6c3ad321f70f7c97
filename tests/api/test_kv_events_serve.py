"""`kvstore serve --kv-events-endpoint`: a subscriber of the running sidecar sees its stores as
vLLM-framed events, replays what it missed, /metrics counts them, and a stop is AllBlocksCleared."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest
import torch
import zmq

from kvstore import KVStoreClient, ModelSpec
from tests.api.test_kv_events_publisher import connected
from kv_event_view import KVEventView
from kvstore.kv_events.wire import AllBlocksCleared, BlockStored, decode_batch

REPO = Path(__file__).resolve().parents[2]
END = (-1).to_bytes(8, "big", signed=True)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_a_subscriber_of_kvstore_serve_sees_its_pages_and_replays(tmp_path):
    port, pub_port, replay_port = free_port(), free_port(), free_port()
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvstore.cli", "serve", "--data-dir", str(tmp_path), "--port", str(port),
         "--cpu-bytes", "16MiB", "--disk-bytes", "0", "--kv-events-endpoint", f"tcp://127.0.0.1:{pub_port}",
         "--kv-events-replay-endpoint", f"tcp://127.0.0.1:{replay_port}", "--kv-events-topic", "kv@pod-a@m"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env, cwd=REPO)
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"kv@")  # llm-d's filter
    try:
        line = proc.stdout.readline()
        if not line:
            pytest.fail(f"kvstore serve did not start: {proc.stderr.read()}")
        assert f"kv events: tcp://127.0.0.1:{pub_port}, replay tcp://127.0.0.1:{replay_port}" in line
        connected(sub, f"tcp://127.0.0.1:{pub_port}")
        spec = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
        tokens = list(range(50, 60))
        with KVStoreClient(f"http://127.0.0.1:{port}") as client:
            client.register_model("m", spec)
            assert client.store("m", tokens, torch.randn(spec.kv_shape(10)).to(torch.float16)).stored_tokens == 10
        live, deadline = [], time.monotonic() + 20
        while sum(isinstance(e, BlockStored) for _, b in live for e in b.events) < 3:
            assert time.monotonic() < deadline, "no events from kvstore serve"
            if sub.poll(100):
                topic, seq, payload = sub.recv_multipart()
                assert topic == b"kv@pod-a@m"
                live.append((int.from_bytes(seq, "big"), decode_batch(payload)))
        stored = [e for _, b in live for e in b.events if isinstance(e, BlockStored)]
        assert [e.token_ids for e in stored] == [tokens[0:4], tokens[4:8], tokens[8:10]]
        # The start-up picture (AllBlocksCleared) went out before this subscriber joined: replay it.
        dealer = ctx.socket(zmq.DEALER)
        dealer.connect(f"tcp://127.0.0.1:{replay_port}")
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(5000)
            _, topic, seq, payload = dealer.recv_multipart()
            if seq == END:
                break
            replayed.append(decode_batch(payload))
        dealer.close(linger=0)
        assert isinstance(replayed[0].events[0], AllBlocksCleared)
        view = KVEventView()
        for batch in replayed:
            view.apply(batch.events)
        assert {medium: len(blocks) for medium, blocks in view.held.items()} == {("CPU", "LOCAL"): 3}
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics") as response:
            metrics = response.read().decode()
        assert "kvstore_kv_events_dropped_total 0.0" in metrics
        assert "kvstore_kv_events_published_total 4.0" in metrics  # AllBlocksCleared and three pages
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, proc.stderr.read()
        last = None
        while sub.poll(500):
            last = decode_batch(sub.recv_multipart()[2])
        assert last is not None and isinstance(last.events[-1], AllBlocksCleared)  # a stopped sidecar holds nothing
    finally:
        sub.close(linger=0)
        if proc.poll() is None:
            proc.kill()
