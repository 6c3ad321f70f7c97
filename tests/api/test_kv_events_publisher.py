"""The sidecar's KV-event stream on real ZeroMQ sockets, framed as vLLM's ZmqEventPublisher
frames it: (topic, 8-byte big-endian seq, msgpack KVEventBatch) on PUB; replays from a start
seq on ROUTER ending in seq -1; a publisher that falls behind drops, counts, leaves a gap and
resyncs; the serve flags and /metrics."""
from __future__ import annotations

import time

import pytest
import torch
import zmq

from bench.kv_events import MODELS, SPEC, run_exactness, store_picture
from kvstore import KVStore, StoreConfig
from kvstore.api.server.config import ServerConfig
from kvstore.kv_events.publisher import KVEventsPublisher, KVEventsPublisherConfig
from kvstore.api.server.metrics import Metrics
from kvstore.api.server.serve import ServeError, kv_events_publisher
from kvstore.cli import build_configs, build_parser
from kvstore.kv_events.subscriber import SidecarEventSource
from kv_event_view import KVEventView
from kvstore.kv_events.wire import AllBlocksCleared, decode_batch

END = (-1).to_bytes(8, "big", signed=True)


@pytest.fixture
def store(tmp_path):
    store = KVStore(StoreConfig(data_dir=str(tmp_path / "data"), cpu_bytes=48 << 10, disk_bytes=0))
    for name, tenant in MODELS:
        store.register_model(name, SPEC, tenant=tenant)
    yield store
    store.close()


def subscriber(endpoint: str) -> zmq.Socket:
    sub = zmq.Context.instance().socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    return connected(sub, endpoint)


def connected(sub: zmq.Socket, endpoint: str, timeout_s: float = 20.0) -> zmq.Socket:
    """`sub` connected to `endpoint` once ZeroMQ's handshake is done (then a moment for the
    subscription to reach the publisher: a PUB drops what it sends before that)."""
    from zmq.utils.monitor import recv_monitor_message

    monitor = sub.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
    sub.connect(endpoint)
    try:
        assert monitor.poll(int(timeout_s * 1000)), f"no ZeroMQ handshake with {endpoint}"
        recv_monitor_message(monitor)
    finally:
        sub.disable_monitor()
        monitor.close(linger=0)
    time.sleep(0.05)
    return sub


def joined(publisher: KVEventsPublisher, sub: zmq.Socket, timeout_s: float = 20.0) -> None:
    """Wait until `sub`'s subscription has reached the publisher's PUB socket, before the
    publisher starts: probes go out on it (its thread not yet running) until one arrives, so the
    first batch can never be dropped by ZeroMQ's slow joiner, however loaded the host."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert time.monotonic() < deadline, "the subscription never reached the publisher"
        publisher._pub.send_multipart((b"probe", b"", b""))
        if sub.poll(100):
            break
    while sub.poll(200):  # the probes still on their way
        assert sub.recv_multipart()[0] == b"probe"


def receive(sub: zmq.Socket, until, timeout_s: float = 20.0) -> list[tuple[bytes, int, bytes]]:
    got: list[tuple[bytes, int, bytes]] = []
    deadline = time.monotonic() + timeout_s
    while not until(got):
        assert time.monotonic() < deadline, f"only {len(got)} messages"
        if sub.poll(50):
            topic, seq, payload = sub.recv_multipart()
            assert len(seq) == 8
            got.append((topic, int.from_bytes(seq, "big"), payload))
    return got


def store_some(store: KVStore, n: int, first: int = 0) -> None:
    for i in range(first, first + n):
        tokens = [i + 1, 2, 3, 4, 5, 6]
        store.store("m", tokens, torch.randn(SPEC.kv_shape(len(tokens))))


def test_churn_through_real_sockets_is_exact_at_every_checkpoint(tmp_path):
    result = run_exactness(1_500, 500, str(tmp_path / "data"), seed=2, zmq=True, restart_rate=0.0015)
    assert len(result.checkpoints) == 3 and result.ops["store"] > 500
    for c in result.checkpoints:
        assert (c.missing, c.phantom, c.lookup_mismatches) == (0, 0, 0), c


def test_frames_replay_and_a_late_subscriber(store):
    config = KVEventsPublisherConfig(endpoint="tcp://127.0.0.1:*", replay_endpoint="tcp://127.0.0.1:*",
                                     topic="kv@pod-a@m", batch_interval_s=0.005)
    publisher = KVEventsPublisher(config)
    try:
        early = subscriber(publisher.endpoint)
        joined(publisher, early)
        publisher.start(store)
        store_some(store, 4)
        live = receive(early, lambda got: sum(len(decode_batch(p).events) for _, _, p in got) >= 1 + 8)
        assert {topic for topic, _, _ in live} == {b"kv@pod-a@m"}
        assert [seq for _, seq, _ in live] == list(range(len(live)))  # no gaps
        assert isinstance(decode_batch(live[0][2]).events[0], AllBlocksCleared)  # attach: the whole picture
        store_some(store, 3, first=10)
        # What a late subscriber asks the ROUTER for: everything from seq 0.
        dealer = zmq.Context.instance().socket(zmq.DEALER)
        dealer.connect(publisher.replay_endpoint)
        dealer.send_multipart((b"", (0).to_bytes(8, "big")))
        replayed = []
        while True:
            assert dealer.poll(5000), "no replay answer"
            empty, topic, seq, payload = dealer.recv_multipart()
            assert empty == b""
            if seq == END:
                assert (topic, payload) == (b"", b"")
                break
            replayed.append((topic, int.from_bytes(seq, "big"), payload))
        seqs = [seq for _, seq, _ in replayed]
        assert seqs[0] == 0 and seqs == list(range(len(seqs)))
        assert replayed[:len(live)] == live  # the very bytes sent live
        # A subscriber that joins now, as the connector runs one: replays from 0, then listens,
        # replaying any gap; it ends with the store's picture.
        source = SidecarEventSource(publisher.endpoint, publisher.replay_endpoint)
        store_some(store, 2, first=20)
        view, deadline = KVEventView(), time.monotonic() + 20
        while True:
            view.apply(source.take())
            if publisher.queued == 0 and source.next_seq >= publisher._seq and view.held == store_picture(store):
                break
            assert time.monotonic() < deadline, (source.next_seq, publisher._seq)
            time.sleep(0.01)
        source.close()
        dealer.close(linger=0)
        early.close(linger=0)
    finally:
        publisher.close()


def test_a_publisher_that_falls_behind_drops_counts_gaps_and_resyncs(store):
    config = KVEventsPublisherConfig(endpoint="tcp://127.0.0.1:*", max_queue_records=2, batch_interval_s=0.5)
    publisher = KVEventsPublisher(config)
    metrics = Metrics(store.stats)
    metrics.watch_kv_events(publisher)
    try:
        sub = subscriber(publisher.endpoint)
        joined(publisher, sub)
        publisher.start(store)
        first = receive(sub, lambda got: len(got) >= 1)  # the picture on attach
        store_some(store, 6)  # far more records than the queue takes before the thread wakes
        assert publisher.dropped > 0
        assert f"kvstore_kv_events_dropped_total {float(publisher.dropped)}" in metrics.render().decode()
        rest = receive(sub, lambda got: got and decode_batch(got[-1][2]).events and publisher.queued == 0
                       and any(isinstance(e, AllBlocksCleared) for _, _, p in got for e in decode_batch(p).events))
        seqs = [seq for _, seq, _ in first + rest]
        assert any(b - a > 1 for a, b in zip(seqs, seqs[1:]))  # the dropped records' gap
        view = KVEventView()
        for _, _, payload in first + rest:
            view.apply(decode_batch(payload).events)
        assert view.held == store_picture(store) and view.held
        sub.close(linger=0)
    finally:
        publisher.close()


def test_serve_flags_build_the_publisher_and_bad_ones_are_named(tmp_path):
    args = build_parser({}).parse_args(["serve", "--kv-events-endpoint", "tcp://127.0.0.1:*",
                                        "--kv-events-replay-endpoint", "tcp://127.0.0.1:*",
                                        "--kv-events-topic", "kv@a@m", "--disk-bytes", "0"])
    _, server = build_configs(args, {})
    assert (server.kv_events_topic, server.kv_events_replay_endpoint) == ("kv@a@m", "tcp://127.0.0.1:*")
    publisher = kv_events_publisher(server)
    try:
        assert publisher.endpoint.startswith("tcp://127.0.0.1:") and publisher.replay_endpoint
        taken = ServerConfig(kv_events_endpoint=publisher.endpoint)
        with pytest.raises(ServeError, match="kv_events: cannot bind"):
            kv_events_publisher(taken)
    finally:
        publisher.close()
    assert kv_events_publisher(ServerConfig()) is None
    with pytest.raises(ValueError, match="kv_events_replay_endpoint: replays need kv_events_endpoint"):
        ServerConfig(kv_events_replay_endpoint="tcp://127.0.0.1:5558")
    with pytest.raises(ValueError, match="kv_events_endpoint: expected a ZeroMQ address"):
        ServerConfig(kv_events_endpoint="127.0.0.1:5557")
    with pytest.raises(ValueError, match="kv_events_max_queue_records"):
        ServerConfig(kv_events_endpoint="tcp://127.0.0.1:5557", kv_events_max_queue_records=0)


def test_a_batch_sent_while_the_source_joins_is_replayed_without_waiting_for_the_next(monkeypatch):
    # The publisher sends seq 2 live before the source's subscription reaches it (ZeroMQ drops
    # it) and then nothing more: the source, not yet live, finds it in the replay buffer anyway.
    import threading

    import kvstore.kv_events.subscriber as sidecar_events
    from kvstore.kv_events.wire import KVEventBatch, encode_batch

    monkeypatch.setattr(sidecar_events, "JOIN_REPLAY_EVERY_S", 0.0)
    ctx = zmq.Context.instance()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    pub.bind("tcp://127.0.0.1:*")
    router.bind("tcp://127.0.0.1:*")
    batches = [encode_batch(KVEventBatch(ts=float(i), events=[AllBlocksCleared()])) for i in range(3)]
    buffered = [2]  # how many batches the replay buffer holds
    stop = threading.Event()

    def answer_replays() -> None:  # the sidecar's ROUTER, on a thread as in the sidecar
        while not stop.is_set():
            if router.poll(20):
                who, empty, start = router.recv_multipart()
                for seq in range(int.from_bytes(start, "big"), buffered[0]):
                    router.send_multipart((who, b"", b"t", seq.to_bytes(8, "big"), batches[seq]))
                router.send_multipart((who, b"", b"", sidecar_events.END_SEQ, b""))

    replays = threading.Thread(target=answer_replays)
    replays.start()
    source = SidecarEventSource(pub.getsockopt_string(zmq.LAST_ENDPOINT), router.getsockopt_string(zmq.LAST_ENDPOINT))
    try:
        got: list = []
        deadline = time.monotonic() + 20
        while source.next_seq != 2:
            assert time.monotonic() < deadline, "the first replay never came"
            got += source.take()
        assert len(got) == 2
        buffered[0] = 3  # seq 2 went out live before the subscription joined: only the buffer has it
        while source.next_seq != 3:
            assert time.monotonic() < deadline, "the batch sent while joining was never replayed"
            got += source.take()
        assert len(got) == 3 and all(isinstance(event, AllBlocksCleared) for event in got)
    finally:
        stop.set()
        replays.join(5)
        source.close()
        pub.close(linger=0)
        router.close(linger=0)
