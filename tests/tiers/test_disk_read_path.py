"""The disk tier's read path as a user sees it: fetches served from LMDB are bit-exact whichever
way a page is read (whole into the answer, part of a page, into a caller's buffer, compressed),
and a record changed on disk after it was read once is a miss, never wrong KV."""
from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from kv_tensors import random_kv

from kvstore import ModelSpec

# Another process rewrites one record (found by its token ids) while the store stays open: a
# flipped header byte, a well-formed header that names another payload checksum, or a flipped
# payload byte.
REWRITE = """
import sys, zlib, lmdb, msgpack
from kvstore.tiers.disk_record import decode_header
path, first_token, how = sys.argv[1], int(sys.argv[2]), sys.argv[3]
env = lmdb.open(path, max_dbs=2)
meta, data = env.open_db(b"meta"), env.open_db(b"data")
with env.begin(write=True) as txn:
    for key, value in txn.cursor(db=meta):
        header = decode_header(value, key)
        if int.from_bytes(header["tokens"][:4], "little") != first_token:
            continue
        if how == "header byte":
            value = bytearray(value)
            value[len(value) // 2] ^= 0x01
            txn.put(key, bytes(value), db=meta)
        elif how == "header checksum":
            header["checksum"] ^= 1
            packed = msgpack.packb(header, use_bin_type=True)
            txn.put(key, (zlib.crc32(packed) & 0xFFFFFFFF).to_bytes(4, "little") + packed, db=meta)
        else:
            payload = bytearray(txn.get(key, db=data))
            payload[len(payload) // 3] ^= 0x01
            txn.put(key, bytes(payload), db=data)
        print("rewritten")
env.close()
"""


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
@pytest.mark.parametrize("compression", ["none", "zstd"])
def test_disk_fetches_are_bit_exact_whole_partial_and_into_a_buffer(make_store, dtype, compression):
    spec = ModelSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype=dtype, page_size=4)
    store = make_store(cpu_bytes=0, disk_compression=compression)
    store.register_model("m", spec)
    tokens = list(range(100, 114))  # 3 full pages + a 2-token tail page
    kv = random_kv(spec, 14)
    store.store("m", tokens, kv)
    assert store.flush(30)

    got = store.fetch("m", tokens)
    assert got.matched_tokens == 14 and torch.equal(got.kv, kv)

    buffer = torch.full((spec.bytes_per_token * 20,), 0xAB, dtype=torch.uint8)
    got = store.fetch("m", tokens, into=buffer)
    assert got.matched_tokens == 14 and torch.equal(got.kv, kv)
    assert got.kv.data_ptr() == buffer.data_ptr()  # the answer is the caller's buffer
    assert torch.all(buffer[spec.bytes_per_token * 14:] == 0xAB)  # nothing written past the answer

    got = store.fetch("m", tokens, start=6)  # the answer starts inside the second page
    assert got.matched_tokens == 14 and torch.equal(got.kv, kv[:, :, 6:])

    asked = tokens[:10] + [7, 7, 7]  # diverges inside the third page
    got = store.fetch("m", asked)
    assert got.matched_tokens == 10 and torch.equal(got.kv, kv[:, :, :10])
    assert store.stats()["corrupt_records"] == 0


@pytest.mark.parametrize("how", ["header byte", "header checksum", "payload byte"])
def test_a_record_changed_on_disk_after_it_was_read_is_a_miss(make_store, spec, tmp_path, how):
    data_dir = tmp_path / "changed"
    store = make_store(data_dir=str(data_dir), cpu_bytes=0)
    store.register_model("m", spec)
    tokens = list(range(200, 212))  # 3 pages
    kv = random_kv(spec, 12)
    store.store("m", tokens, kv)
    assert store.flush(30)
    got = store.fetch("m", tokens)  # every record read (and its header decoded) once
    assert got.matched_tokens == 12 and torch.equal(got.kv, kv)

    done = subprocess.run([sys.executable, "-c", REWRITE, str(data_dir / "pages"), str(tokens[4]), how],
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["rewritten"], done.stderr

    got = store.fetch("m", tokens)
    assert got.matched_tokens == 4 and torch.equal(got.kv, kv[:, :, :4])  # up to the changed page
    assert store.stats()["corrupt_records"] == 1
    assert store.fetch("m", tokens).matched_tokens == 4  # deleted: it stays a miss


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_a_disk_hit_is_promoted_and_then_served_bit_exact_from_the_cpu_tier(make_store, dtype):
    spec = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype=dtype, page_size=4)
    store = make_store(cpu_bytes=spec.page_bytes * 4)
    store.register_model("m", spec)
    tokens, other = list(range(10)), list(range(500, 516))  # 2 pages + a tail page; 4 pages
    kv = random_kv(spec, 10, 1)
    store.store("m", tokens, kv)
    store.store("m", other, random_kv(spec, 16, 2))  # pushes the first prompt down to disk
    assert store.lookup("m", tokens).tiers == {"disk": 10}

    got = store.fetch("m", tokens)
    assert got.matched_tokens == 10 and torch.equal(got.kv, kv)
    assert store.lookup("m", tokens).tiers == {"cpu": 10}  # every page promoted on the way
    assert store.stats()["tiers"]["cpu"]["promotions"] == 3
    got.kv.zero_()  # the promoted copies are the tier's own, not views of the answer
    again = store.fetch("m", tokens)
    assert again.matched_tokens == 10 and torch.equal(again.kv, kv)


def test_a_one_page_answer_is_bit_exact_and_its_changed_payload_a_miss(make_store, spec, tmp_path):
    # A fetch of exactly one page: its rows are the whole answer, one contiguous block.
    data_dir = tmp_path / "one"
    store = make_store(data_dir=str(data_dir), cpu_bytes=0)
    store.register_model("m", spec)
    tokens = list(range(300, 300 + spec.page_size))
    kv = random_kv(spec, spec.page_size)
    store.store("m", tokens, kv)
    assert store.flush(30)
    got = store.fetch("m", tokens)
    assert got.matched_tokens == spec.page_size and torch.equal(got.kv, kv)

    done = subprocess.run([sys.executable, "-c", REWRITE, str(data_dir / "pages"), str(tokens[0]), "payload byte"],
                          capture_output=True, text=True, timeout=120)
    assert done.stdout.split() == ["rewritten"], done.stderr
    got = store.fetch("m", tokens)
    assert got.matched_tokens == 0 and store.stats()["corrupt_records"] == 1
