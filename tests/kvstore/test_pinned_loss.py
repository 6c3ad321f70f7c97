"""A page whose only copy goes bad while several requests hold it (a corrupt disk record read by
one fetch while another has planned the same pages): every request finishes, the page and the
pages after it are a miss from then on, and the sequence can be stored again."""
from __future__ import annotations

import lmdb
import torch
from kv_tensors import random_kv


def test_a_page_lost_under_two_fetches_leaves_both_finishing_and_the_sequence_storable(make_store, spec):
    tokens = list(range(1, 13))  # 3 full pages
    kv = random_kv(spec, 12)
    store = make_store(cpu_bytes=0)  # the disk tier alone: every read is a record
    store.register_model("m", spec)
    assert store.store("m", tokens, kv).stored_tokens == 12
    data_dir = store.config.data_dir
    store.close()
    env = lmdb.open(f"{data_dir}/pages", max_dbs=2)
    data = env.open_db(b"data")
    with env.begin(write=True) as txn:  # one flipped bit in every payload: the first page is bad
        for key, value in list(txn.cursor(data)):
            txn.put(key, bytes([value[0] ^ 1]) + value[1:], db=data)
    env.close()

    store = make_store(cpu_bytes=0)
    store.register_model("m", spec)
    first, second = store._plan_fetch("m", tokens), store._plan_fetch("m", tokens)
    assert first.matched_tokens == second.matched_tokens == 12
    assert first.run().matched_tokens == 0  # the corrupt page is a miss, never wrong KV
    second.release()
    assert store.lookup("m", tokens).matched_tokens == 0
    assert store.fetch("m", tokens).matched_tokens == 0
    assert store.store("m", tokens, kv).stored_tokens == 12
    got = store.fetch("m", tokens)
    assert got.matched_tokens == 12 and torch.equal(got.kv, kv)
