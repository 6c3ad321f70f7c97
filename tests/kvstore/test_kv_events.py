"""KV events from the store: a subscriber that applies them in order holds, per medium, exactly
the pages the store holds, through stores, promotions, demotions, evictions from both tiers,
dropped models and restarts; a refused store reports nothing."""
from __future__ import annotations

import msgpack
import pytest
import torch

from bench.kv_events import MODELS, SPEC, Churn, MemorySubscriber, check, run_exactness, store_picture
from kvstore import KVStore, StoreConfig
from kvstore.errors import InsufficientStorage, InvalidKV
from kvstore.kv_events.log import KVEventLog
from kv_event_view import KVEventView
from kvstore.keys import page_key, tokens_bytes
from kvstore.kv_events.packing import RecordPacker
from kvstore.kv_events.recorder import CLEARED, REMOVED, STORED, record_to_event
from kvstore.kv_events.wire import (AllBlocksCleared, BlockRemoved, BlockStored, KVEventBatch, block_hash, decode_batch,
                               encode_batch)


def test_churn_of_ten_thousand_operations_is_exact_at_every_checkpoint(tmp_path):
    result = run_exactness(10_000, 2_500, str(tmp_path / "data"), seed=1, restart_rate=0.0003)
    assert sum(result.ops.values()) == 10_000
    for op in ("store", "store_chunk", "fetch", "lookup", "drop_model", "restart"):
        assert result.ops.get(op, 0) > 0, op
    # Every kind of move a router must follow happened, many times.
    assert result.moves["cpu demotions"] > 1000 and result.moves["cpu promotions"] > 1000
    assert result.moves["disk evictions"] > 1000
    assert len(result.checkpoints) == 4
    for c in result.checkpoints:
        assert c.pages > 50
        assert (c.missing, c.phantom, c.lookup_mismatches) == (0, 0, 0), c


def open_store(tmp_path, **overrides) -> KVStore:
    fields = dict(data_dir=str(tmp_path / "data"), cpu_bytes=48 << 10, disk_bytes=1 << 20)
    fields.update(overrides)
    store = KVStore(StoreConfig(**fields))
    for name, tenant in MODELS:
        store.register_model(name, SPEC, tenant=tenant)
    return store


def kv(n: int) -> torch.Tensor:
    return torch.randn(SPEC.kv_shape(n))


def test_a_missed_event_shows_at_the_checkpoint(tmp_path):
    """The comparison can fail: a subscriber that lost one BlockRemoved holds a phantom page."""
    store = open_store(tmp_path)
    sub = MemorySubscriber()
    sub.attach(store)
    churn = Churn(0)
    for _ in range(3):
        tokens = churn.sequence()
        churn.stored.append((0, tokens))
        store.store("m", tokens, kv(len(tokens)))
    assert check(store, sub, churn, 3).phantom == 0
    store.drop_model("m")
    store.register_model("m", SPEC)
    events = sub.log.take(store)
    removed = [e for e in events if isinstance(e, BlockRemoved)]
    assert removed
    sub.view.apply([e for e in events if e is not removed[0]])
    assert check(store, sub, churn, 4).phantom == 1
    store.close()


def test_events_carry_keys_parent_tokens_block_size_model_and_medium(tmp_path):
    store = open_store(tmp_path)
    log = KVEventLog()
    store.attach_kv_events(log)
    assert log.take(store) == [AllBlocksCleared()]  # an empty store's whole picture
    tokens = list(range(1, 11))  # two full pages of 4 and a tail of 2
    store.store("m", tokens, kv(10), tenant="acme")
    stored = log.take(store)
    assert [type(e) for e in stored] == [BlockStored] * 3
    first, second, tail = stored
    assert [e.token_ids for e in stored] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    assert first.parent_block_hash is None
    assert second.parent_block_hash == first.block_hashes[0] and tail.parent_block_hash == second.block_hashes[0]
    assert {(e.medium, e.locality, e.block_size) for e in stored} == {("CPU", "LOCAL", 4)}
    assert {tuple(e.extra_keys) for e in stored} == {(("m", "acme"),)}
    assert all(0 <= e.block_hashes[0] < 1 << 64 for e in stored)  # page keys as 64-bit block hashes
    assert len({e.block_hashes[0] for e in stored}) == 3
    store.close()  # writes the memory pages to disk, then serves nothing
    *saved, last = log.take()
    assert {e.medium for e in saved} == {"STORAGE"} and len(saved) == 3 and last == AllBlocksCleared()


def test_a_refused_store_reports_nothing(tmp_path):
    store = open_store(tmp_path, disk_bytes=0)
    log = KVEventLog()
    store.attach_kv_events(log)
    log.take(store)
    with pytest.raises(InvalidKV):
        store.store("m", [1, 2, 3, 4, 5], kv(4))  # KV for four tokens, five given
    store.set_tenant_quota("acme", 100)  # less than one page: no room for any
    with pytest.raises(InsufficientStorage):
        store.store("m", [1, 2, 3, 4], kv(4), tenant="acme")
    assert log.take(store) == []
    assert store.lookup("m", [1, 2, 3, 4], tenant="acme").matched_tokens == 0
    store.close()


def test_pages_stored_in_parts_are_reported_once_whole(tmp_path):
    """Tensor-parallel ranks' head parts: no event until a page has every head, then the same
    events a whole store reports."""
    store = open_store(tmp_path, disk_bytes=0)
    log = KVEventLog()
    store.attach_kv_events(log)
    log.take(store)
    tokens, whole = list(range(1, 11)), kv(10)
    store.store("m", tokens, whole[:, :, :, :1].contiguous(), heads=(0, 1))
    assert log.take(store) == []
    store.store("m", tokens, whole[:, :, :, 1:].contiguous(), heads=(1, 2))
    stored = log.take(store)
    assert [type(e) for e in stored] == [BlockStored] * 3
    assert [e.token_ids for e in stored] == [[1, 2, 3, 4], [5, 6, 7, 8], [9, 10]]
    store.close()


def test_demotion_and_promotion_move_a_page_between_media(tmp_path):
    store = open_store(tmp_path, cpu_bytes=SPEC.page_bytes * 2 + 64)
    log, view = KVEventLog(), KVEventView()
    store.attach_kv_events(log)
    first = [1, 2, 3, 4]
    store.store("m", first, kv(4))
    for n in range(3):  # pushes `first` out of the CPU tier to disk
        store.store("m", [100 + n, 2, 3, 4], kv(4))
    view.apply(log.take(store))
    key = block_hash(page_key(store._registry.get("m", None).namespace, tokens_bytes(first)))
    assert view.holds(key) == [("STORAGE", "LOCAL")]
    assert store.lookup("m", first).tiers == {"disk": 4}
    store.fetch("m", first)  # promoted back into the CPU tier; still on disk
    view.apply(log.take(store))
    assert sorted(view.holds(key)) == [("CPU", "LOCAL"), ("STORAGE", "LOCAL")]
    assert store_picture(store) == {m: blocks for m, blocks in view.held.items() if blocks}
    store.close()


def test_a_restart_sends_all_blocks_cleared_then_what_the_disk_holds(tmp_path):
    store = open_store(tmp_path)
    store.store("m", list(range(1, 9)), kv(8))
    store.close()  # writes the memory pages to disk
    store = open_store(tmp_path)
    log, view = KVEventLog(), KVEventView()
    view.held[("CPU", "LOCAL")] = {12345}  # what a subscriber held from before the restart
    store.attach_kv_events(log)
    events = log.take(store)
    assert isinstance(events[0], AllBlocksCleared)
    assert [(e.medium, e.token_ids) for e in events[1:]] == [("STORAGE", [1, 2, 3, 4]), ("STORAGE", [5, 6, 7, 8])]
    view.apply(events)
    assert view.held == store_picture(store)
    store.close()


def test_a_log_that_falls_behind_resyncs_and_counts_what_it_dropped(tmp_path):
    store = open_store(tmp_path, disk_bytes=0)
    log, view = KVEventLog(max_records=2), KVEventView()
    store.attach_kv_events(log)
    for n in range(5):
        store.store("m", [n + 1, 2, 3, 4, 5, 6, 7, 8], kv(8))
    assert log.dropped > 0
    view.apply(log.take(store))
    assert view.held == store_picture(store)
    store.close()


def test_the_publishers_fast_encoding_is_the_events_encoding(tmp_path):
    store = open_store(tmp_path)
    log = KVEventLog()
    store.attach_kv_events(log)
    store.store("m", list(range(1, 11)), kv(10), tenant="acme")
    store.drop_model("m", tenant="acme")
    records = log.take_records(store)
    assert {r[0] for r in records} == {STORED, REMOVED, CLEARED}
    events = [record_to_event(r) for r in records]
    packer = RecordPacker()
    assert packer.pack(1.0, records, 0) == encode_batch(KVEventBatch(1.0, events, 0))
    many = records * 7  # past 16 events: a longer array header
    assert packer.pack(2.5, many, None) == encode_batch(KVEventBatch(2.5, [record_to_event(r) for r in many], None))
    assert decode_batch(encode_batch(KVEventBatch(1.0, events, 0))).events == events
    store.close()


def test_a_shared_redis_tier_is_remote_storage_for_every_sidecar(tmp_path):
    from tests.tiers.redis_helpers import REDIS_SERVER, RedisServer

    if REDIS_SERVER is None:
        pytest.skip("redis-server is not installed")
    server = RedisServer(tmp_path / "redis")
    try:
        stores = [open_store(tmp_path / name, disk_bytes=0, redis_url=server.url, redis_timeout_s=0.5)
                  for name in ("a", "b")]
        logs, views = [KVEventLog(), KVEventLog()], [KVEventView(), KVEventView()]
        for store, log in zip(stores, logs):
            store.attach_kv_events(log)
        tokens = list(range(1, 9))
        stores[0].store("m", tokens, kv(8))
        stores[0].flush()
        assert stores[1].fetch("m", tokens).matched_tokens == 8  # found in Redis, promoted to b's CPU tier
        for store, log, view in zip(stores, logs, views):
            view.apply(log.take(store))
            assert view.held == store_picture(store)
            assert {m: len(b) for m, b in view.held.items()} == {("CPU", "LOCAL"): 2, ("STORAGE", "REMOTE"): 2}
        for store in stores:
            store.close()
    finally:
        server.stop()


@pytest.mark.parametrize("kind", ["BlockMoved", None, ["BlockStored"], {"a": 1}])
def test_an_unknown_event_type_is_refused_by_name(kind):
    # A type that is not a string (a list, a map) too: once the table lookup raised TypeError.
    payload = msgpack.packb([1.0, [{"type": kind}], 0], use_bin_type=True)
    with pytest.raises(ValueError, match="unknown event type"):
        decode_batch(payload)
