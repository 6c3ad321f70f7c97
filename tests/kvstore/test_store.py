"""KVStore as a user sees it: hits, bytes, tensors and errors."""
from __future__ import annotations

import dataclasses
import threading

import numpy as np
import pytest
import torch
from kv_tensors import random_kv

from kvstore import ModelSpec
from kvstore.errors import (InsufficientStorage, InvalidKV, InvalidModelName, InvalidStart, InvalidTokens,
                            ModelConflict, ModelNotFound)


def test_store_then_fetch_is_bit_exact(make_store, spec):
    store = make_store()
    store.register_model("m", spec)
    tokens = list(range(1, 11))  # 2 full pages + a 2-token tail page
    kv = random_kv(spec, 10)
    assert store.store("m", tokens, kv).stored_tokens == 10
    got = store.fetch("m", tokens)
    assert got.matched_tokens == 10
    assert torch.equal(got.kv, kv)
    assert store.lookup("m", tokens).matched_tokens == 10


def test_seed_example_reuses_every_shared_token(make_store):
    # |This is the||end.| cached; |This is the||end. Just kidding| asks: all 6 shared tokens reuse.
    spec = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float32", page_size=3)
    store = make_store()
    store.register_model("m", spec)
    cached = [10, 11, 12, 13, 14]  # "This is the" | "end."  (a full page and a tail page)
    kv = random_kv(spec, 5)
    store.store("m", cached, kv)
    asked = cached + [20, 21, 22]  # "... Just kidding"
    assert store.lookup("m", asked).matched_tokens == 5
    got = store.fetch("m", asked)
    assert got.matched_tokens == 5 and torch.equal(got.kv, kv)


def store_tokens(make_store, spec: ModelSpec, n: int):
    """A store holding `n` tokens (0, 1, ...) of random KV under model "m": (store, tokens, kv)."""
    store = make_store()
    store.register_model("m", spec)
    tokens = list(range(n))
    kv = random_kv(spec, n)
    store.store("m", tokens, kv)
    return store, tokens, kv


def test_reuse_ends_inside_a_page(make_store, spec):
    store, tokens, kv = store_tokens(make_store, spec, 8)
    asked = tokens[:6] + [99, 98]  # diverges inside the second page
    got = store.fetch("m", asked)
    assert got.matched_tokens == 6
    assert torch.equal(got.kv, kv[:, :, :6])
    assert store.lookup("m", asked).matched_tokens == 6


def test_fetch_with_start_and_lookup_agree(make_store, spec):
    store, tokens, kv = store_tokens(make_store, spec, 13)
    got = store.fetch("m", tokens, start=5)
    assert got.matched_tokens == 13 and torch.equal(got.kv, kv[:, :, 5:])
    assert store.fetch("m", [7, 7, 7]).matched_tokens == 0  # a miss is not an error
    assert store.fetch("m", [7, 7, 7]).kv.shape == spec.kv_shape(0)


def test_store_with_start_extends_a_cached_prefix(make_store, spec):
    store = make_store()
    store.register_model("m", spec)
    tokens = list(range(14))
    kv = random_kv(spec, 14)
    store.store("m", tokens[:6], kv[:, :, :6])
    result = store.store("m", tokens, kv[:, :, 6:], start=6)  # start inside page 1
    assert result.stored_tokens == 14
    assert torch.equal(store.fetch("m", tokens).kv, kv)


def test_store_with_start_after_eviction_stores_nothing(make_store, spec):
    store = make_store()
    store.register_model("m", spec)
    result = store.store("m", list(range(8)), random_kv(spec, 4), start=4)
    assert result == type(result)(0, 0)
    assert store.lookup("m", list(range(8))).matched_tokens == 0


def test_tail_page_is_extended_by_a_longer_store(make_store, spec):
    store = make_store()
    store.register_model("m", spec)
    kv = random_kv(spec, 12)
    tokens = list(range(12))
    store.store("m", tokens[:6], kv[:, :, :6])
    store.store("m", tokens, kv)
    assert torch.equal(store.fetch("m", tokens).kv, kv)
    assert torch.equal(store.fetch("m", tokens[:6]).kv, kv[:, :, :6])
    assert store.stats()["pages"] == 3  # the 2-token tail page was folded into the full page


def test_tokens_accepted_as_tensor_and_numpy(make_store, spec):
    import numpy as np

    store = make_store()
    store.register_model("m", spec)
    kv = random_kv(spec, 8)
    store.store("m", torch.arange(8), kv)
    assert store.lookup("m", np.arange(8, dtype=np.int32)).matched_tokens == 8


@pytest.mark.parametrize("case", ["shape", "dtype", "count", "type"])
def test_bad_kv_raises_and_stores_nothing(make_store, spec, case):
    store = make_store()
    store.register_model("m", spec)
    kv = random_kv(spec, 8)
    bad = {"shape": kv[:, :1], "dtype": kv.float(), "count": kv[:, :, :7], "type": kv.tolist()}[case]
    with pytest.raises(InvalidKV, match="kv"):
        store.store("m", list(range(8)), bad)
    assert store.lookup("m", list(range(8))).matched_tokens == 0
    assert store.stats()["pages"] == 0


@pytest.mark.parametrize("tokens", [[-1, 2, 3, 4], [1, 2, 2**31, 4], [1.5, 2, 3, 4], "abcd", [True, 1, 2, 3],
                                    np.array([1, -2, 3, 4], dtype="<i4"), np.array([1, 2, 2**31, 4], dtype="<i8"),
                                    np.array([[1, 2], [3, 4]], dtype="<i4")])
def test_bad_tokens_raise_and_store_nothing(make_store, spec, tokens):
    store = make_store()
    store.register_model("m", spec)
    with pytest.raises(InvalidTokens, match="tokens"):
        store.store("m", tokens, random_kv(spec, 4))
    assert store.stats()["pages"] == 0


@pytest.mark.parametrize("as_array", [lambda t: np.array(t, dtype="<i4"), lambda t: np.array(t, dtype=">i4"),
                                      lambda t: np.array(t, dtype=np.int64), torch.tensor])
def test_token_arrays_are_the_same_prompt_as_lists(make_store, spec, as_array):
    store = make_store()
    store.register_model("m", spec)
    kv = random_kv(spec, 8)
    store.store("m", as_array(list(range(8))), kv)
    assert store.lookup("m", list(range(8))).matched_tokens == 8
    assert torch.equal(store.fetch("m", as_array(list(range(10))), start=2).kv, kv[:, :, 2:])


def test_bad_start_and_models(make_store, spec):
    store = make_store()
    store.register_model("m", spec)
    with pytest.raises(InvalidStart, match="start"):
        store.fetch("m", [1, 2, 3], start=4)
    with pytest.raises(InvalidStart, match="start"):
        store.store("m", [1, 2, 3], random_kv(spec, 0), start=-1)
    with pytest.raises(ModelNotFound, match="other"):
        store.lookup("other", [1, 2])
    with pytest.raises(InvalidModelName, match="model"):
        store.register_model("", spec)
    store.register_model("m", spec)  # idempotent
    other = ModelSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
    with pytest.raises(ModelConflict, match="num_layers"):
        store.register_model("m", other)


def test_namespaces_never_share_pages(make_store, spec):
    store = make_store()
    other_spec = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4, rope_theta=5e5)
    store.register_model("a", spec)
    store.register_model("b", spec)
    store.register_model("c", other_spec)
    store.register_model("a", spec, tenant="t2")
    tokens = list(range(8))
    store.store("a", tokens, random_kv(spec, 8))
    assert store.lookup("a", tokens).matched_tokens == 8
    assert store.lookup("b", tokens).matched_tokens == 0
    assert store.lookup("c", tokens).matched_tokens == 0
    assert store.lookup("a", tokens, tenant="t2").matched_tokens == 0


def test_drop_model_removes_its_pages(make_store, spec):
    store = make_store()
    store.register_model("a", spec)
    store.register_model("b", spec)
    store.store("a", list(range(8)), random_kv(spec, 8))
    store.store("b", list(range(8)), random_kv(spec, 8))
    assert store.drop_model("a") == 2
    with pytest.raises(ModelNotFound):
        store.lookup("a", list(range(8)))
    store.register_model("a", spec)
    assert store.lookup("a", list(range(8))).matched_tokens == 0
    assert store.lookup("b", list(range(8))).matched_tokens == 8


def test_tiers_stay_within_capacity_and_demote(make_store):
    spec = ModelSpec(num_layers=4, num_kv_heads=4, head_dim=64, dtype="float16", page_size=4)  # 16 KiB pages
    cpu_pages = 3
    store = make_store(cpu_bytes=spec.page_bytes * cpu_pages, disk_bytes=1 << 20)
    store.register_model("m", spec)
    seqs = [[i * 100 + t for t in range(8)] for i in range(30)]
    kvs = [random_kv(spec, 8, seed=i) for i in range(30)]
    for seq, kv in zip(seqs, kvs):
        store.store("m", seq, kv)
        tiers = store.stats()["tiers"]
        for name, tier in tiers.items():
            assert tier["bytes"] <= tier["capacity_bytes"], name
    tiers = store.stats()["tiers"]
    assert tiers["cpu"]["pages"] == cpu_pages
    assert tiers["cpu"]["demotions"] > 0 and tiers["disk"]["evictions"] > 0  # the disk tier dropped some
    recent = store.fetch("m", seqs[-1])
    assert recent.matched_tokens == 8 and torch.equal(recent.kv, kvs[-1])
    for seq, kv in zip(seqs, kvs):  # whatever is served is exact
        got = store.fetch("m", seq)
        assert torch.equal(got.kv, kv[:, :, :got.matched_tokens])


def test_disk_tier_hit_is_promoted(make_store, spec):
    store = make_store(cpu_bytes=spec.page_bytes * 2)
    store.register_model("m", spec)
    a, b = list(range(8)), list(range(100, 108))
    kv_a = random_kv(spec, 8, 1)
    store.store("m", a, kv_a)
    store.store("m", b, random_kv(spec, 8, 2))
    assert store.lookup("m", a).tiers == {"disk": 8}
    assert torch.equal(store.fetch("m", a).kv, kv_a)
    assert store.lookup("m", a).tiers == {"cpu": 8}
    assert store.stats()["tiers"]["cpu"]["promotions"] == 2


def test_pinned_pages_are_never_evicted(make_store, spec):
    # A fetch pins its pages while it copies; a concurrent store that needs room must not take them.
    store = make_store(cpu_bytes=spec.page_bytes * 2, disk_bytes=0, data_dir=None)
    store.register_model("m", spec)
    kv = random_kv(spec, 8)
    store.store("m", list(range(8)), kv)
    tokens = torch.arange(8, dtype=torch.int32).numpy().tobytes()
    node = store._index.match(store._model("m", None).namespace, tokens, 4).path
    for page in node:
        store._placement.pin(page)
    with pytest.raises(Exception, match="no tier has room"):
        store.store("m", list(range(100, 104)), random_kv(spec, 4))
    assert torch.equal(store.fetch("m", list(range(8))).kv, kv)


def test_close_and_reopen_keeps_disk_pages(make_store, spec, tmp_path):
    data_dir = str(tmp_path / "reopen")
    store = make_store(data_dir=data_dir, cpu_bytes=spec.page_bytes * 2)
    store.register_model("m", spec)
    seqs = {i: [i * 1000 + t for t in range(10)] for i in range(6)}
    kvs = {i: random_kv(spec, 10, i) for i in seqs}
    for i in seqs:
        store.store("m", seqs[i], kvs[i])
    store.close()
    again = make_store(data_dir=data_dir, cpu_bytes=spec.page_bytes * 2)
    assert again.get_spec("m") == spec  # the registry survived too
    for i in seqs:
        assert again.lookup("m", seqs[i]).matched_tokens == 10
        got = again.fetch("m", seqs[i])
        assert got.matched_tokens == 10 and torch.equal(got.kv, kvs[i])


def test_flipped_byte_in_disk_record_is_a_miss(make_store, spec, tmp_path):
    import lmdb

    data_dir = str(tmp_path / "corrupt")
    store = make_store(data_dir=data_dir, cpu_bytes=0)
    store.register_model("m", spec)
    tokens = list(range(8))
    kv = random_kv(spec, 8)
    store.store("m", tokens, kv)
    store.close()
    env = lmdb.open(f"{data_dir}/pages", max_dbs=2)
    data = env.open_db(b"data")
    with env.begin(write=True, db=data) as txn:
        keys = [k for k, _ in txn.cursor()]
        second = sorted(keys)[0]
        value = bytearray(txn.get(second))
        value[len(value) // 2] ^= 0xFF
        txn.put(second, bytes(value))
    env.close()
    again = make_store(data_dir=data_dir, cpu_bytes=0)
    got = again.fetch("m", tokens)
    assert torch.equal(got.kv, kv[:, :, :got.matched_tokens])  # never wrong KV
    assert got.matched_tokens < 8
    assert again.stats()["corrupt_records"] == 1
    assert again.fetch("m", tokens).matched_tokens == got.matched_tokens  # deleted, stays a miss


CRASHING_WRITER = """
import os, sys, torch
from kvstore import KVStore, StoreConfig, ModelSpec
spec = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
store = KVStore(StoreConfig(data_dir=sys.argv[1], durability=sys.argv[2]))
store.register_model("m", spec)
kv = torch.randn(spec.kv_shape(10), generator=torch.Generator().manual_seed(0)).half()
store.store("m", list(range(10)), kv)
torch.save(kv, sys.argv[1] + "/kv.pt")
os._exit(0)  # as a crash: no close, no flush
"""


def test_write_through_pages_survive_a_crash(make_store, spec, tmp_path):
    import subprocess
    import sys

    data_dir = str(tmp_path / "wt")
    subprocess.run([sys.executable, "-c", CRASHING_WRITER, data_dir, "write-through"], check=True, timeout=120)
    store = make_store(data_dir=data_dir)
    kv = torch.load(data_dir + "/kv.pt")
    got = store.fetch("m", list(range(10)))
    assert got.matched_tokens == 10 and torch.equal(got.kv, kv)


def test_eight_threads_store_and_fetch_overlapping_prefixes(make_store, spec):
    store = make_store(cpu_bytes=spec.page_bytes * 40, disk_bytes=2 << 20)
    store.register_model("m", spec)
    base = list(range(12))
    truth = random_kv(spec, 40, seed=7)  # KV is a function of position here, so every prefix is consistent
    errors: list[BaseException] = []

    def worker(worker_id: int) -> None:
        try:
            gen = torch.Generator().manual_seed(worker_id)
            for _ in range(60):
                n = int(torch.randint(1, 28, (1,), generator=gen))
                tokens = base + list(range(100, 100 + n))
                if int(torch.randint(0, 2, (1,), generator=gen)):
                    store.store("m", tokens, truth[:, :, :len(tokens)])
                got = store.fetch("m", tokens)
                assert torch.equal(got.kv, truth[:, :, :got.matched_tokens])
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors, errors[0]
    assert store.lookup("m", base).matched_tokens == 12


@pytest.mark.parametrize("policy", ["lru", "lru-tail", "seen-before", "duel"])  # research ones: tests/bench
def test_a_sequence_just_stored_is_served_whole_under_pressure(make_store, spec, policy):
    # Every policy: a full prompt stored a moment ago (its last page is full) is fetched whole,
    # even when the tier is full of older sequences.
    store = make_store(cpu_bytes=spec.page_bytes * 10, disk_bytes=0, data_dir=None, policy=policy)
    store.register_model("m", spec)
    for i in range(30):
        tokens = [i * 100 + t for t in range(16)]  # 4 full pages
        kv = random_kv(spec, 16, seed=i)
        store.store("m", tokens, kv)
        got = store.fetch("m", tokens)
        assert got.matched_tokens == 16 and torch.equal(got.kv, kv), (policy, i)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_every_dtype_and_layout_round_trips_bit_exact_from_any_start(make_store, spec, dtype):
    # Whole pages are copied as numpy views (bfloat16 as its int16 bits), partial ones through
    # the codec; the caller's tensor may be a strided view, and a fetch may start inside a page.
    spec = dataclasses.replace(spec, dtype=dtype)
    store = make_store()
    store.register_model("m", spec)
    tokens = list(range(1, 11))  # 2 full pages + a 2-token tail page
    kv = random_kv(spec, 10)
    strided = kv.transpose(2, 3).contiguous().transpose(2, 3)  # the same values, not contiguous
    assert not strided.is_contiguous()
    assert store.store("m", tokens, strided).stored_tokens == 10
    for start in (0, 2, 4, 9):
        got = store.fetch("m", tokens, start=start)
        assert got.matched_tokens == 10 and got.kv.dtype == kv.dtype
        assert torch.equal(got.kv, kv[:, :, start:])


def test_a_store_refused_for_room_leaves_its_cached_prefix_evictable(make_store, spec):
    # Room for one page, which the prefix holds: its continuation finds no tier with room (the
    # prefix is pinned while the store runs) and is refused; the prefix must not stay pinned. The
    # next store's page takes its room, evicting the model's last page: it must be matchable.
    store = make_store(cpu_bytes=spec.page_bytes, disk_bytes=0, data_dir=None)
    store.register_model("m", spec)
    store.store("m", [1, 2, 3, 4], random_kv(spec, 4, seed=1))
    with pytest.raises(InsufficientStorage):
        store.store("m", [1, 2, 3, 4, 5, 6, 7, 8], random_kv(spec, 8, seed=2))
    kv = random_kv(spec, 4, seed=3)
    assert store.store("m", [9, 10, 11, 12], kv).stored_tokens == 4  # the prefix's page made room
    assert torch.equal(store.fetch("m", [9, 10, 11, 12]).kv, kv)
    assert store.lookup("m", [1, 2, 3, 4]).matched_tokens == 0
