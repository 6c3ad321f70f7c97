"""Per-tier codecs through the store: capacity gained, error bounded, bytes saved reported."""
import pytest
import torch
from kv_tensors import random_kv

from kvstore import ModelSpec


@pytest.fixture
def spec128():
    return ModelSpec(num_layers=2, num_kv_heads=2, head_dim=128, dtype="float16", page_size=16)


def fill(store, spec, sequences):
    store.register_model("m", spec)
    for i in range(sequences):
        store.store("m", [i * 1000 + t for t in range(spec.page_size)], random_kv(spec, spec.page_size, i))


def test_int8_cpu_tier_holds_1_9x_the_pages(make_store, spec128):
    cpu_bytes = spec128.page_bytes * 40
    plain = make_store(cpu_bytes=cpu_bytes, disk_bytes=0, data_dir=None)
    int8 = make_store(cpu_bytes=cpu_bytes, disk_bytes=0, data_dir=None, cpu_codec="int8")
    fill(plain, spec128, 200)
    fill(int8, spec128, 200)
    plain_pages = plain.stats()["tiers"]["cpu"]["pages"]
    int8_pages = int8.stats()["tiers"]["cpu"]["pages"]
    assert plain_pages == 40
    assert int8_pages >= 1.9 * plain_pages
    tier = int8.stats()["tiers"]["cpu"]
    assert tier["codec"] == "int8" and tier["bytes"] <= cpu_bytes
    assert tier["saved_bytes"] >= 0.45 * int8_pages * spec128.page_bytes


@pytest.mark.parametrize("codec", ["int8", "fp8"])
def test_quantized_tiers_serve_within_their_bound(make_store, spec128, codec):
    store = make_store(cpu_codec=codec, disk_codec=codec, cpu_bytes=spec128.page_bytes * 2)
    store.register_model("m", spec128)
    tokens = list(range(40))  # 2 full pages and a tail page; one page ends up on disk
    kv = random_kv(spec128, 40)
    store.store("m", tokens, kv)
    got = store.fetch("m", tokens)
    assert got.matched_tokens == 40 and got.kv.dtype == kv.dtype
    # Per token per head: int8 errs by at most half a step of max|x|/127; fp8 e4m3 by 2^-4 relative.
    amax = kv.float().abs().amax(dim=-1, keepdim=True)
    err = (got.kv.float() - kv.float()).abs()
    bound = amax / 127 * 0.51 if codec == "int8" else kv.float().abs() * 2**-4 + amax * 2**-9
    assert bool((err <= bound + 1e-3).all())
    assert not torch.equal(got.kv, kv)  # it really was quantized
