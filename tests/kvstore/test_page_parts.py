"""Pages written in parts (heads= / layers=) and read in slices: what each rank of a
tensor-parallel engine sees, in-process (kvstore/page_parts.py, kvstore/page_slice.py)."""
from __future__ import annotations

import threading

import pytest
import torch

from kvstore import KVStore, ModelSpec, StoreConfig
from kvstore.errors import InsufficientStorage, InvalidKV, InvalidRequest, PartConflict
from tests.kv_tensors import random_kv

MODEL = "m"


@pytest.fixture
def spec3() -> ModelSpec:  # three KV heads, as SmolLM2's: TP=3 gives one head a rank
    return ModelSpec(num_layers=3, num_kv_heads=3, head_dim=4, dtype="float32", page_size=4)


@pytest.fixture
def store(make_store, spec3) -> KVStore:
    s = make_store(cpu_bytes=1 << 20, disk_bytes=0, data_dir=None)
    s.register_model(MODEL, spec3)
    return s


def tp_heads(H: int, tp: int) -> list[tuple[int, int]]:
    return [(r * H // tp, (r + 1) * H // tp) for r in range(tp)]


def test_parts_are_invisible_until_every_head_is_stored(store, spec3):
    tokens = list(range(10))  # two full pages and a tail of two
    kv = random_kv(spec3, 10)
    for i, heads in enumerate(tp_heads(3, 3)):
        if i:  # every reader sees nothing while any head is missing
            assert store.lookup(MODEL, tokens).matched_tokens == 0
            assert store.fetch(MODEL, tokens).matched_tokens == 0
            assert store.stats()["pages"] == 0
        result = store.store(MODEL, tokens, kv[:, :, :, heads[0]:heads[1]], heads=heads)
        assert result.stored_tokens == 10  # this rank's part of every page is held
    assert store.lookup(MODEL, tokens).matched_tokens == 10
    got = store.fetch(MODEL, tokens)
    assert got.matched_tokens == 10 and torch.equal(got.kv, kv)
    assert store.stats()["partial_pages"] == {"pages": 0, "bytes": 0, "given_up": 0}


@pytest.mark.parametrize("tp", [1, 2, 3])
def test_a_page_stored_whole_is_read_in_slices_of_any_degree(store, spec3, tp):
    tokens = list(range(100, 113))
    kv = random_kv(spec3, 13, seed=tp)
    store.store(MODEL, tokens, kv)
    for start in (0, 3, 8):
        for heads in tp_heads(3, tp) if tp > 1 else [None]:
            got = store.fetch(MODEL, tokens, start=start, heads=heads)
            h = heads or (0, 3)
            assert got.matched_tokens == 13
            assert torch.equal(got.kv, kv[:, :, start:, h[0]:h[1]])


def test_slices_of_layers_and_heads_together(store, spec3):
    tokens = list(range(9))
    kv = random_kv(spec3, 9)
    for layers in [(0, 1), (1, 3)]:
        for heads in [(0, 2), (2, 3)]:
            store.store(MODEL, tokens, kv[layers[0]:layers[1], :, :, heads[0]:heads[1]], layers=layers, heads=heads)
    got = store.fetch(MODEL, tokens, layers=(1, 2), heads=(1, 3))
    assert torch.equal(got.kv, kv[1:2, :, :, 1:3])
    assert torch.equal(store.fetch(MODEL, tokens).kv, kv)


def test_degrees_share_pages_both_ways(store, spec3):
    """TP=3 stores, a TP=1 reader and a TP=2 reader... and the reverse on other tokens."""
    tokens = list(range(200, 232))
    kv = random_kv(spec3, 32, seed=5)
    for heads in tp_heads(3, 3):
        store.store(MODEL, tokens, kv[:, :, :, heads[0]:heads[1]].clone(), heads=heads)
    assert torch.equal(store.fetch(MODEL, tokens).kv, kv)
    for heads in [(0, 2), (2, 3)]:  # an uneven split is a split too
        assert torch.equal(store.fetch(MODEL, tokens, heads=heads).kv, kv[:, :, :, heads[0]:heads[1]])


def test_overlapping_part_is_refused_and_leaves_nothing_claimed(store, spec3):
    tokens = list(range(8))
    kv = random_kv(spec3, 8)
    store.store(MODEL, tokens, kv[:, :, :, 0:2], heads=(0, 2))
    with pytest.raises(PartConflict) as err:
        store.store(MODEL, tokens + [9, 9, 9, 9], random_kv(spec3, 12)[:, :, :, 1:3], heads=(1, 3))
    assert err.value.field == "heads" and err.value.status == 409
    # The refused store staged nothing: its pages past the conflict were never claimed.
    assert store.stats()["partial_pages"]["pages"] == 2
    # The same part again is a no-op, and the missing head completes the pages.
    assert store.store(MODEL, tokens, kv[:, :, :, 0:2], heads=(0, 2)).stored_tokens == 8
    assert store.lookup(MODEL, tokens).matched_tokens == 0
    store.store(MODEL, tokens, kv[:, :, :, 2:3], heads=(2, 3))
    assert torch.equal(store.fetch(MODEL, tokens).kv, kv)


def test_a_part_of_a_stored_page_is_a_no_op(store, spec3):
    tokens = list(range(8))
    kv = random_kv(spec3, 8)
    store.store(MODEL, tokens, kv)
    other = random_kv(spec3, 8, seed=9)
    result = store.store(MODEL, tokens, other[:, :, :, 1:2], heads=(1, 2))
    assert (result.stored_tokens, result.new_pages) == (8, 0)
    assert torch.equal(store.fetch(MODEL, tokens).kv, kv)
    assert store.stats()["partial_pages"]["pages"] == 0


@pytest.mark.parametrize("field,value", [("heads", (0, 4)), ("heads", (2, 2)), ("heads", (-1, 1)),
                                         ("heads", "0:1"), ("heads", (0, 1, 2)), ("layers", (0, 9)),
                                         ("heads", (True, 2))])
def test_bad_ranges_name_their_field(store, spec3, field, value):
    kv = random_kv(spec3, 4)
    with pytest.raises(InvalidRequest) as err:
        store.store(MODEL, [1, 2, 3, 4], kv, **{field: value})
    assert err.value.field == field and err.value.status == 400
    with pytest.raises(InvalidRequest) as err:
        store.fetch(MODEL, [1, 2, 3, 4], **{field: value})
    assert err.value.field == field


def test_kv_of_the_wrong_part_shape_is_refused(store, spec3):
    with pytest.raises(InvalidKV) as err:
        store.store(MODEL, [1, 2, 3, 4], random_kv(spec3, 4), heads=(0, 1))
    assert "heads (0, 1)" in str(err.value)


def test_a_part_never_completed_is_given_up(make_store, spec3, monkeypatch):
    clock = [1000.0]  # the staging area's clock, moved by hand: no test that a slow host can fail
    monkeypatch.setattr("kvstore.partial_pages.time.monotonic", lambda: clock[0])
    store = make_store(cpu_bytes=1 << 20, disk_bytes=0, data_dir=None, part_timeout_s=30)
    store.register_model(MODEL, spec3)
    tokens = list(range(12))
    kv = random_kv(spec3, 12)
    store.store(MODEL, tokens, kv[:, :, :, :1], heads=(0, 1))
    clock[0] += 29.9
    waiting = store.stats()["partial_pages"]
    assert waiting["pages"] == 3 and waiting["bytes"] == 12 * spec3.bytes_per_token
    clock[0] += 0.2
    assert store.lookup(MODEL, tokens).matched_tokens == 0
    assert store.stats()["partial_pages"] == {"pages": 0, "bytes": 0, "given_up": 3}
    # The other ranks' late parts start over: nothing is served from the given-up part.
    store.store(MODEL, tokens, kv[:, :, :, 1:], heads=(1, 3))
    assert store.lookup(MODEL, tokens).matched_tokens == 0


def test_parts_past_part_bytes_are_refused(make_store, spec3):
    store = make_store(cpu_bytes=1 << 20, disk_bytes=0, data_dir=None, part_bytes=2 * spec3.page_bytes)
    store.register_model(MODEL, spec3)
    kv = random_kv(spec3, 12)
    assert store.store(MODEL, list(range(12)), kv[:, :, :, :1], heads=(0, 1)).stored_tokens == 8
    with pytest.raises(InsufficientStorage):
        store.store(MODEL, list(range(50, 54)), kv[:, :, :4, :1], heads=(0, 1))


def test_a_rank_that_never_stores_leaves_nothing_visible(store, spec3):
    """Two of three ranks store; the third was killed: no reader ever sees a page."""
    tokens = list(range(40))
    kv = random_kv(spec3, 40)
    for heads in [(0, 1), (2, 3)]:
        store.store(MODEL, tokens, kv[:, :, :, heads[0]:heads[1]], heads=heads)
    assert store.lookup(MODEL, tokens).matched_tokens == 0
    assert store.fetch(MODEL, tokens, heads=(0, 1)).matched_tokens == 0


def test_a_later_chunk_chains_onto_parts_of_its_prefix(store, spec3):
    """Ranks store a prompt in two steps (chunked prefill), at different times."""
    tokens = list(range(16))
    kv = random_kv(spec3, 16)
    ranks = tp_heads(3, 3)
    for heads in ranks[:2]:  # ranks 0 and 1 store both chunks before rank 2 stores anything
        h = slice(*heads)
        assert store.store(MODEL, tokens[:8], kv[:, :, :8, h], heads=heads).stored_tokens == 8
        assert store.store(MODEL, tokens, kv[:, :, 8:, h], start=8, heads=heads).stored_tokens == 16
    h = slice(*ranks[2])
    # Its prefix is not held: nothing of this chunk is taken.
    assert store.store(MODEL, tokens, kv[:, :, 8:, h], start=8, heads=ranks[2]).stored_tokens == 0
    store.store(MODEL, tokens[:8], kv[:, :, :8, h], heads=ranks[2])
    assert store.lookup(MODEL, tokens).matched_tokens == 8
    store.store(MODEL, tokens, kv[:, :, 8:, h], start=8, heads=ranks[2])
    assert torch.equal(store.fetch(MODEL, tokens).kv, kv)


def test_ranks_storing_at_once_make_whole_pages(store, spec3):
    tokens = list(range(64))
    kv = random_kv(spec3, 64, seed=3)
    errors: list[BaseException] = []

    def rank(heads):
        try:
            for end in range(16, 65, 16):  # chunked prefill: each rank stores as its steps finish
                store.store(MODEL, tokens[:end], kv[:, :, end - 16:end, heads[0]:heads[1]], start=end - 16,
                            heads=heads)
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(h,)) for h in tp_heads(3, 3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    assert torch.equal(store.fetch(MODEL, tokens).kv, kv)


def test_parts_reach_the_disk_tier_whole(make_store, spec3, tmp_path):
    store = make_store(cpu_bytes=0, disk_bytes=8 << 20)
    store.register_model(MODEL, spec3)
    tokens = list(range(20))
    kv = random_kv(spec3, 20)
    for heads in tp_heads(3, 3):
        store.store(MODEL, tokens, kv[:, :, :, heads[0]:heads[1]], heads=heads)
    assert torch.equal(store.fetch(MODEL, tokens, heads=(1, 2)).kv, kv[:, :, :, 1:2])
    store.close()
    reopened = KVStore(StoreConfig(data_dir=str(tmp_path / "data"), cpu_bytes=0, disk_bytes=8 << 20))
    try:
        assert torch.equal(reopened.fetch(MODEL, tokens).kv, kv)
    finally:
        reopened.close()


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_a_slice_of_coded_pages_is_that_slice_of_the_whole_answer(make_store, spec3, codec):
    """Pages a codec holds are decoded whole and sliced: the slice equals the whole answer's."""
    store = make_store(cpu_bytes=1 << 20, disk_bytes=0, data_dir=None, cpu_codec=codec)
    store.register_model(MODEL, spec3)
    tokens = list(range(30))
    store.store(MODEL, tokens, random_kv(spec3, 30))
    whole = store.fetch(MODEL, tokens, start=5).kv
    for heads, layers in [((0, 1), None), ((1, 3), (1, 3)), (None, (2, 3))]:
        got = store.fetch(MODEL, tokens, start=5, heads=heads, layers=layers).kv
        h, ly = heads or (0, 3), layers or (0, 3)
        assert torch.equal(got, whole[ly[0]:ly[1], :, :, h[0]:h[1]])


def test_parts_from_inside_a_stored_tail_page_take_its_first_tokens_from_the_store(store, spec3):
    """A rank's store starting mid-page (after a stored tail): the page's first tokens come
    from the store's copy, sliced to the rank's heads, and the page is stored whole."""
    tokens = list(range(40, 52))
    kv = random_kv(spec3, 12)
    store.store(MODEL, tokens[:6], kv[:, :, :6])  # a page of 4 and a tail of 2
    for heads in tp_heads(3, 3):
        h = slice(*heads)
        assert store.store(MODEL, tokens, kv[:, :, 6:, h], start=6, heads=heads).stored_tokens == 12
    assert torch.equal(store.fetch(MODEL, tokens).kv, kv)
