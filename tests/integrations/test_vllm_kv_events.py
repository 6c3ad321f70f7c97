"""KV events and vLLM: the connector's `take_events()` reports, under vLLM's block hashes, which
of an engine's blocks the store holds and in which medium, as vLLM's own event structs, which
vLLM's publisher sends and vLLM's decoder reads; the sidecar's stream decodes with vLLM's
decoder too."""
from __future__ import annotations

import hashlib
import socket
import time

import msgspec
import pytest
import torch
import zmq

vllm_events = pytest.importorskip("vllm.distributed.kv_events")

from kvstore import KVStore, ModelSpec, StoreConfig  # noqa: E402
from kvstore.kv_events.publisher import KVEventsPublisher, KVEventsPublisherConfig  # noqa: E402
from kvstore.integrations.connector_config import ConnectorConfig  # noqa: E402
from kvstore.integrations.store_link import StoreLink  # noqa: E402
from kvstore.kv_events.subscriber import SidecarEventSource  # noqa: E402
from kvstore.integrations.vllm_kv_events import ConnectorEvents, StoreEventSource  # noqa: E402
from kvstore.integrations.vllm_scheduler import SchedulerSide  # noqa: E402
from tests.integrations.test_vllm_scheduler import request, step  # noqa: E402
from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash  # noqa: E402

BLOCK = 32
SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=16)
PAGE_BYTES = SPEC.page_bytes
DECODER = msgspec.msgpack.Decoder(type=vllm_events.KVEventBatch)


def vllm_hashes(prompt: list[int]) -> list[bytes]:
    """Stand-ins for vLLM's chained block hashes (32 bytes each, one a full block); its events
    carry them converted (`maybe_convert_block_hash`)."""
    hashes, parent = [], b"seed"
    for s in range(0, len(prompt) - len(prompt) % BLOCK, BLOCK):
        parent = hashlib.sha256(parent + bytes(str(prompt[s:s + BLOCK]), "ascii")).digest()
        hashes.append(parent)
    return hashes


@pytest.fixture
def connector(tmp_path):
    """The scheduler side of a connector with an in-process store (a CPU tier of six blocks and a
    disk tier), its KV events on."""
    config = ConnectorConfig.from_extra_config({"data_dir": str(tmp_path), "cpu_bytes": 12 * PAGE_BYTES + 512,
                                                "disk_bytes": "1MiB"})
    link = StoreLink(config, "m", SPEC)
    events = ConnectorEvents(StoreEventSource(link.in_process_store), "m", SPEC, BLOCK)
    side = SchedulerSide(link, BLOCK, events)
    yield side, link, events
    events.close()
    link.close()


def save_prompt(side: SchedulerSide, link: StoreLink, req_id: str, prompt: list[int], ok: bool = True,
                salt: str | None = None) -> list[bytes]:
    """What vLLM does for a new request whose whole prompt is computed in one step: the scheduler
    plans the save, the worker stores the blocks (or fails to)."""
    hashes = vllm_hashes(prompt)
    req = request(req_id, prompt, salt, block_hashes=hashes)
    side.on_new_request(req)
    blocks = list(range(len(prompt) // BLOCK + 1))
    (save,) = side.build_meta(step(new=[(req_id, blocks, 0, len(prompt))])).saves
    n = len(save.tokens)
    kv = torch.randn(SPEC.kv_shape(n if ok else n - 1)).to(torch.bfloat16)
    assert (link.store(save.tokens, kv, 0, save.salt) == n) is ok
    side.request_finished(req)
    return hashes


def test_a_saved_prompt_is_reported_under_vllms_hashes_with_its_medium(connector):
    side, link, events = connector
    prompt = list(range(1, 3 * BLOCK + 5))  # three whole blocks and a few tokens
    hashes = [maybe_convert_block_hash(h) for h in save_prompt(side, link, "a", prompt)]
    stored = events.take()
    assert all(isinstance(e, vllm_events.BlockStored) for e in stored)
    assert [e.block_hashes for e in stored] == [[h] for h in hashes]
    assert [e.parent_block_hash for e in stored] == [None, *hashes[:2]]
    assert [e.token_ids for e in stored] == [prompt[i * BLOCK:(i + 1) * BLOCK] for i in range(3)]
    assert {(e.block_size, e.medium, e.locality) for e in stored} == {(BLOCK, "CPU", "LOCAL")}
    assert events.take() == []  # each change once


def test_demotion_eviction_and_a_failed_save_as_vllm_sees_them(connector):
    side, link, events = connector
    first = [maybe_convert_block_hash(h) for h in save_prompt(side, link, "a", list(range(1, 2 * BLOCK + 1)))]
    events.take()
    # Six more blocks fill the CPU tier (six blocks): the first prompt's go down to disk.
    for i in range(3):
        save_prompt(side, link, f"b{i}", [1000 * (i + 1) + t for t in range(2 * BLOCK + 1)])
    moved = [e for e in events.take() if e.block_hashes[0] in first]
    removed = {(e.block_hashes[0], e.medium) for e in moved if isinstance(e, vllm_events.BlockRemoved)}
    stored = {(e.block_hashes[0], e.medium) for e in moved if isinstance(e, vllm_events.BlockStored)}
    assert removed == {(h, "CPU") for h in first} and stored == {(h, "STORAGE") for h in first}
    # A save the store refuses (KV of the wrong length) reports nothing.
    save_prompt(side, link, "c", [7] * (2 * BLOCK + 1), ok=False)
    assert events.take() == []


def test_blocks_the_store_already_holds_are_reported_when_a_request_expects_them(connector):
    side, link, events = connector
    prompt = list(range(1, 2 * BLOCK + 1))
    kv = torch.randn(SPEC.kv_shape(len(prompt))).to(torch.bfloat16)
    assert link.store(prompt, kv, 0, None) == len(prompt)  # another engine's pages, say
    assert events.take() == []  # no request of this engine names those blocks yet
    hashes = vllm_hashes(prompt)
    side.on_new_request(request("a", prompt + [5], block_hashes=hashes))
    (save,) = side.build_meta(step(new=[("a", [0, 1, 2], 0, len(prompt) + 1)])).saves
    assert [e.block_hashes for e in events.take()] == [[maybe_convert_block_hash(h)] for h in hashes]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def subscribe(endpoint: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    time.sleep(0.3)  # ZeroMQ's slow joiner
    return sub


def receive_batches(sub: zmq.Socket, events: int) -> list:
    batches, deadline = [], time.monotonic() + 10
    while sum(len(b.events) for b in batches) < events:
        assert time.monotonic() < deadline
        if sub.poll(50):
            _, seq, payload = sub.recv_multipart()
            batches.append(DECODER.decode(payload))
    return batches


def test_the_connectors_events_go_out_through_vllms_own_publisher(connector):
    side, link, events = connector
    hashes = [maybe_convert_block_hash(h) for h in save_prompt(side, link, "a", list(range(1, 2 * BLOCK + 1)))]
    endpoint = f"tcp://127.0.0.1:{free_port()}"
    sub = zmq.Context.instance().socket(zmq.SUB)  # binds: vLLM's publisher connects to a host address
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.bind(endpoint)
    publisher = vllm_events.ZmqEventPublisher(0, endpoint=endpoint)
    try:
        deadline = time.monotonic() + 10
        while not sub.poll(50):  # until the connection is up (ZeroMQ drops what is sent before)
            assert time.monotonic() < deadline
            publisher.publish(vllm_events.KVEventBatch(ts=time.time(), events=[]))
        while sub.poll(200):
            sub.recv_multipart()
        # What vLLM's scheduler does each step: its own events, then the connector's, in one batch.
        publisher.publish(vllm_events.KVEventBatch(ts=time.time(), events=list(events.take())))
        (batch,) = receive_batches(sub, 2)
        assert [(e.block_hashes, e.medium) for e in batch.events] == [([h], "CPU") for h in hashes]
        sub.close(linger=0)
    finally:
        publisher.shutdown()


def test_vllms_decoder_reads_the_sidecars_stream(tmp_path):
    store = KVStore(StoreConfig(data_dir=str(tmp_path), cpu_bytes=4 * PAGE_BYTES + 256, disk_bytes=1 << 20))
    store.register_model("m", SPEC, tenant="acme")
    publisher = KVEventsPublisher(KVEventsPublisherConfig(endpoint="tcp://127.0.0.1:*", batch_interval_s=0.005))
    try:
        sub = subscribe(publisher.endpoint)
        publisher.start(store)
        P = SPEC.page_size
        tokens = list(range(1, 6 * P + 1))  # six pages: four fit the CPU tier, two go to disk
        store.store("m", tokens, torch.randn(SPEC.kv_shape(len(tokens))).to(torch.bfloat16), tenant="acme")
        got = [e for b in receive_batches(sub, 1 + 6) for e in b.events]
        assert isinstance(got[0], vllm_events.AllBlocksCleared)
        pages = [tokens[i:i + P] for i in range(0, len(tokens), P)]
        assert [(e.token_ids, e.medium) for e in got[1:]] == [(p, "CPU") for p in pages[:4]] + [
            (p, "STORAGE") for p in pages[4:]]
        assert {tuple(e.extra_keys[0]) for e in got[1:]} == {("m", "acme")}
        assert [e.parent_block_hash for e in got[2:]] == [e.block_hashes[0] for e in got[1:-1]]
        other = [9000 + t for t in range(2 * P)]  # two more pages push two out of the CPU tier
        store.store("m", other, torch.randn(SPEC.kv_shape(len(other))).to(torch.bfloat16), tenant="acme")
        more = [e for b in receive_batches(sub, 6) for e in b.events]
        assert sorted((type(e).__name__, e.medium) for e in more) == sorted(
            [("BlockRemoved", "CPU")] * 2 + [("BlockStored", "STORAGE")] * 2 + [("BlockStored", "CPU")] * 2)
        sub.close(linger=0)
    finally:
        publisher.close()
        store.close()


def test_with_a_sidecar_the_connector_reads_the_sidecars_stream(tmp_path):
    """The connector's events from a sidecar's ZeroMQ stream (kv_events_endpoint): the same
    blocks, joined late (the sidecar's start-up picture comes from its replay buffer)."""
    config = ConnectorConfig.from_extra_config({"data_dir": str(tmp_path), "cpu_bytes": "16MiB", "disk_bytes": 0})
    link = StoreLink(config, "m", SPEC)
    sidecar = KVEventsPublisher(KVEventsPublisherConfig(endpoint="tcp://127.0.0.1:*",
                                                        replay_endpoint="tcp://127.0.0.1:*", batch_interval_s=0.005))
    sidecar.start(link.in_process_store)  # the sidecar's publisher, on the store the link writes
    source = SidecarEventSource(sidecar.endpoint, sidecar.replay_endpoint)
    events = ConnectorEvents(source, "m", SPEC, BLOCK)
    side = SchedulerSide(link, BLOCK, events)
    try:
        time.sleep(0.1)  # ZeroMQ's slow joiner
        hashes = [maybe_convert_block_hash(h) for h in save_prompt(side, link, "a", list(range(1, 2 * BLOCK + 1)))]
        salted = [maybe_convert_block_hash(h)
                  for h in save_prompt(side, link, "s", list(range(500, 500 + 2 * BLOCK + 1)), salt="conv-1")]
        got, deadline = [], time.monotonic() + 10
        while len(got) < 4:
            assert time.monotonic() < deadline, got
            got += events.take()
            time.sleep(0.02)
        assert [(e.block_hashes, e.medium) for e in got] == [([h], "CPU") for h in hashes + salted]
        time.sleep(0.1)
        assert events.take() == []
    finally:
        events.close()
        sidecar.close()
        link.close()
