"""A whole `KVStore` with the stand-in device tier (tests/tiers/off_host_tier.py) on top of the
CPU, disk and Redis tiers: what the GPU tier meets in a real store, on a machine without CUDA.

Pages stored past the device's room are demoted down the stack (encoded on the device, only
host bytes reach a record tier); a hit promotes them back; `flush` returns; `close` saves pages
held only on the device to disk, and a reopened store serves them. Where every codec on a page's
way is `none` its KV comes back bit for bit; through int8/fp8 it comes back as the codec's
round trip of the page, exactly. Nothing stored is lost while the tiers below have room."""
from __future__ import annotations

import pytest
import torch
from kv_tensors import random_kv
from off_host_tier import OffHostTier
from redis_helpers import REDIS_SERVER, NEEDS_REDIS, RedisServer

import kvstore.tier_stack
from kvstore import KVStore, ModelSpec
from kvstore.codecs import get_codec
from kvstore.tiers.cpu import CPUTier
from kvstore.tiers.disk import DiskTier
from kvstore.tiers.gpu import GPUTier
from kvstore.tiers.redis import RedisTier

SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=4)
P = SPEC.page_size
SEQUENCES = 8  # of 3 pages each (two full pages and a one-token tail): 24 pages
FLUSH_S = 20.0  # a writer that died never flushes: the test fails at this bound instead of hanging


def _sequences() -> list[tuple[list[int], torch.Tensor]]:
    out = []
    for i in range(SEQUENCES):
        tokens = list(range(1000 * (i + 1), 1000 * (i + 1) + 2 * P + 1))
        out.append((tokens, random_kv(SPEC, len(tokens), seed=10 + i)))  # (L, 2, T, H, D)
    return out


def _roundtrip(codec_name: str, kv: torch.Tensor) -> torch.Tensor:
    codec = get_codec(codec_name)
    n = kv.shape[2]
    data = torch.empty(codec.encoded_bytes(SPEC, n), dtype=torch.uint8)
    codec.encode(SPEC, kv.contiguous(), data)
    out = torch.empty_like(kv)
    codec.decode(SPEC, data, n, out)
    return out


def _page_tiers(store: KVStore, tokens: list[int]) -> list[str]:
    """The tier each page of `tokens` is served from: the difference of the lookups of the
    prefixes that end with it and with the page before."""
    tiers, before = [], {}
    for end in range(P, len(tokens) + P, P):
        found = store.lookup("m", tokens[:min(end, len(tokens))]).tiers
        grew = [tier for tier, n in found.items() if n > before.get(tier, 0)]
        assert len(grew) == 1, (found, before)
        tiers.append(grew[0])
        before = found
    return tiers


@pytest.fixture(params=[OffHostTier, pytest.param(GPUTier, marks=pytest.mark.gpu)], ids=["stand-in", "cuda"])
def top(request) -> type:
    """The device tier on top: the stand-in everywhere, the real GPU tier where CUDA is."""
    return request.param


@pytest.fixture
def make_store(monkeypatch, make_store, top):
    """tests/conftest.py's stores (closed after the test) with `top` (or `device_tier`) above the
    CPU, disk and Redis tiers, each tier off unless given, "m" registered."""
    monkeypatch.setattr(OffHostTier, "made", [])

    def make(*, device_tier: type | None = None, **fields) -> KVStore:
        tier = device_tier or top
        monkeypatch.setattr(kvstore.tier_stack, "TIER_TYPES", (tier, CPUTier, DiskTier, RedisTier))
        store = make_store(**{"gpu_bytes": 4 * tier.slot_bytes(SPEC.page_bytes), "cpu_bytes": 0, "disk_bytes": 0,
                              **fields})
        store.register_model("m", SPEC)
        return store

    return make


def _check_cascade(store: KVStore, codecs: dict[str, str]) -> list[tuple[list[int], torch.Tensor]]:
    """Store more than the device holds, flush, and fetch every sequence once: each page equals
    the round trip of the first quantizing codec on its way down (the raw page where there is
    none). Returns the sequences."""
    sequences = _sequences()
    for tokens, kv in sequences:
        assert store.store("m", tokens, kv).stored_tokens == len(tokens)
    assert store.flush(FLUSH_S), "a tier's writes never finished (a dead writer)"
    # Past the device's room, every page but the last few left it: demoted, or (Redis, written
    # at store time) already held below.
    assert store.stats()["tiers"]["gpu"]["evictions"] >= 3 * SEQUENCES - 4
    order = [tier for tier in ("gpu", "cpu", "disk", "redis") if tier in store.stats()["tiers"]]
    for tokens, kv in sequences:
        assert store.lookup("m", tokens).matched_tokens == len(tokens), "a stored page was lost"
        expected = kv.clone()
        for p, tier in enumerate(_page_tiers(store, tokens)):
            way = [codecs[t] for t in order[1:order.index(tier) + 1] if codecs[t] != "none"]
            if way:
                lo, hi = p * P, min((p + 1) * P, len(tokens))
                expected[:, :, lo:hi] = _roundtrip(way[0], kv[:, :, lo:hi])
        got = store.fetch("m", tokens)
        assert got.matched_tokens == len(tokens)
        assert torch.equal(got.kv.view(torch.int16), expected.view(torch.int16))
        # The hit promoted the sequence back onto the device, where it is served from now on.
        assert store.lookup("m", tokens).tiers == {"gpu": len(tokens)}
        again = store.fetch("m", tokens)
        assert torch.equal(again.kv.view(torch.int16), expected.view(torch.int16))
    assert store.stats()["tiers"]["gpu"]["promotions"] > 0
    assert store.flush(FLUSH_S)
    return sequences


def test_device_pages_reach_disk_as_host_bytes(make_store):
    """The device directly over the disk: every demotion is a device page written as a record."""
    store = make_store(disk_bytes=1 << 20)
    demotions = store.stats()["tiers"]["gpu"]["demotions"]
    _check_cascade(store, {"disk": "none"})
    demotions = store.stats()["tiers"]["gpu"]["demotions"] - demotions
    assert demotions >= 3 * SEQUENCES - 4
    if OffHostTier.made:  # every one encoded on the device, then copied down
        assert OffHostTier.made[0].copies_out == demotions


@pytest.mark.parametrize("cpu_codec,disk_codec", [("none", "none"), ("int8", "int8"), ("none", "fp8"),
                                                  ("fp8", "none")])
def test_device_over_cpu_over_disk_close_and_reopen(make_store, cpu_codec, disk_codec):
    cpu_bytes = 6 * CPUTier.slot_bytes(get_codec(cpu_codec).encoded_bytes(SPEC, P))
    config = {"cpu_bytes": cpu_bytes, "disk_bytes": 1 << 20, "cpu_codec": cpu_codec, "disk_codec": disk_codec}
    store = make_store(**config)
    sequences = _check_cascade(store, {"cpu": cpu_codec, "disk": disk_codec})
    served = {tuple(tokens): store.fetch("m", tokens).kv for tokens, _ in sequences}
    # A sequence stored last is held only on the device: close must save it to disk.
    fresh = list(range(90_000, 90_000 + 2 * P + 1))
    fresh_kv = random_kv(SPEC, len(fresh), seed=99)
    assert store.store("m", fresh, fresh_kv).stored_tokens == len(fresh)
    assert store.lookup("m", fresh).tiers == {"gpu": len(fresh)}
    store.close()
    reopened = make_store(**config)
    assert reopened.lookup("m", fresh).tiers == {"disk": len(fresh)}, "a page held only on the device was lost"
    got = reopened.fetch("m", fresh)
    assert torch.equal(got.kv.view(torch.int16), _roundtrip(disk_codec, fresh_kv).view(torch.int16))
    if disk_codec == "none":
        assert torch.equal(got.kv.view(torch.int16), fresh_kv.view(torch.int16))
    for tokens, kv in sequences:
        assert reopened.lookup("m", tokens).tiers == {"disk": len(tokens)}, "a page was not saved at close"
        got = reopened.fetch("m", tokens)
        assert got.matched_tokens == len(tokens)
        # A page reaches disk as its bytes where it had a copy there already or the codecs on
        # its way agree, else re-encoded at close from what it served: exactly one of the two.
        before = served[tuple(tokens)]
        for lo in range(0, len(tokens), P):
            page, was = got.kv[:, :, lo:lo + P].view(torch.int16), before[:, :, lo:lo + P]
            assert torch.equal(page, was.view(torch.int16)) or \
                torch.equal(page, _roundtrip(disk_codec, was).view(torch.int16))
        if cpu_codec == disk_codec == "none":
            assert torch.equal(got.kv.view(torch.int16), kv.view(torch.int16))


def test_write_through_and_flush_with_pages_on_the_device(make_store):
    store = make_store(cpu_bytes=1 << 16, disk_bytes=1 << 20, durability="write-through")
    tokens = list(range(7, 7 + 3 * P))
    kv = random_kv(SPEC, len(tokens), seed=3)
    assert store.store("m", tokens, kv).stored_tokens == len(tokens)
    assert store.flush(FLUSH_S)
    assert store.lookup("m", tokens).tiers == {"gpu": len(tokens)}
    store.close()
    reopened = make_store(cpu_bytes=1 << 16, disk_bytes=1 << 20)
    assert torch.equal(reopened.fetch("m", tokens).kv.view(torch.int16), kv.view(torch.int16))


def test_every_read_and_write_of_pages_on_the_device(make_store):
    """The store's other ways in and out, with the pages on the device: a fetch from an offset
    into a caller's buffer, a tensor-parallel rank's heads and a pipeline stage's layers, a
    pinned fetch (whose pages are not in host memory, so it copies), pages stored in parts, and
    CacheBlend's chunks."""
    store = make_store(gpu_bytes=64 * SPEC.page_bytes, disk_bytes=1 << 20)
    tokens = list(range(500, 500 + 3 * P + 2))
    kv = random_kv(SPEC, len(tokens), seed=5)
    store.store("m", tokens, kv)
    assert store.lookup("m", tokens).tiers == {"gpu": len(tokens)}
    into = torch.empty(kv.numel() * kv.element_size(), dtype=torch.uint8)
    got = store.fetch("m", tokens, start=P + 1, into=into)
    assert torch.equal(got.kv.view(torch.int16), kv[:, :, P + 1:].view(torch.int16))
    got = store.fetch("m", tokens, heads=(1, 2), layers=(0, 1))
    assert torch.equal(got.kv.view(torch.int16), kv[0:1, :, :, 1:2].view(torch.int16))
    with store.fetch_pinned("m", tokens) as pinned:
        assert pinned.runs is None  # the device's pages are not views in host memory
        assert torch.equal(pinned.fetch().kv.view(torch.int16), kv.view(torch.int16))

    parted = list(range(700, 700 + 2 * P))
    whole = random_kv(SPEC, len(parted), seed=6)
    for lo, hi in ((0, 1), (1, 2)):  # two ranks, one KV head each
        store.store("m", parted, whole[:, :, :, lo:hi].contiguous(), heads=(lo, hi))
    assert store.lookup("m", parted).tiers == {"gpu": len(parted)}
    assert torch.equal(store.fetch("m", parted).kv.view(torch.int16), whole.view(torch.int16))

    chunk = list(range(900, 900 + 2 * P))
    chunk_kv = random_kv(SPEC, len(chunk), seed=7)
    store.store_chunk("m", chunk, chunk_kv)
    at_zero = store.blend("m", [chunk], start_pos=0)
    assert at_zero.hits == [True] and torch.equal(at_zero.kv.view(torch.int16), chunk_kv.view(torch.int16))
    moved = store.blend("m", [chunk], start_pos=5)
    assert moved.hits == [True] and torch.equal(moved.kv[:, 1].view(torch.int16), chunk_kv[:, 1].view(torch.int16))
    store.close()  # every page is on the device only: all reach disk
    reopened = make_store(gpu_bytes=64 * SPEC.page_bytes, disk_bytes=1 << 20)
    for seq, expected in ((tokens, kv), (parted, whole)):
        assert torch.equal(reopened.fetch("m", seq).kv.view(torch.int16), expected.view(torch.int16))
    assert reopened.blend("m", [chunk], start_pos=0).hits == [True]


@pytest.mark.skipif(REDIS_SERVER is None, reason=NEEDS_REDIS)
@pytest.mark.parametrize("disk_codec", ["none", "int8"])
def test_device_pages_reach_redis_as_host_bytes(make_store, tmp_path, disk_codec):
    """The device directly over Redis (which takes the disk's codec), and a second store that
    shares the Redis finds what the first demoted."""
    server = RedisServer(tmp_path / "redis")
    try:
        config = {"redis_url": server.url, "redis_timeout_s": 2.0, "disk_codec": disk_codec}
        store = make_store(**config)
        sequences = _check_cascade(store, {"redis": disk_codec})
        store.close()
        other = make_store(data_dir=str(tmp_path / "other"), **config)
        in_redis = [(tokens, kv) for tokens, kv in sequences if other.lookup("m", tokens).matched_tokens]
        assert len(in_redis) >= SEQUENCES - 2  # all but what was on the device at close
        for tokens, kv in in_redis:
            got = other.fetch("m", tokens)
            assert got.matched_tokens == len(tokens)
            expected = _roundtrip(disk_codec, kv)  # written from the stored KV, through the codec
            assert torch.equal(got.kv.view(torch.int16), expected.view(torch.int16))
        other.close()
    finally:
        server.stop()


@pytest.mark.gpu
@pytest.mark.parametrize("top", [GPUTier], ids=["cuda"])
@pytest.mark.parametrize("cpu_codec,disk_codec", [("none", "none"), ("int8", "int8"), ("none", "fp8")])
def test_gpu_store_serves_what_the_cpu_only_store_serves(make_store, tmp_path, cpu_codec, disk_codec):
    """The same requests to a store with the GPU tier on top and to one with the stand-in (CPU
    only: the codecs' torch references instead of the CUDA kernels) get the same answers, bit
    for bit, before and after close and reopen."""
    answers = {}
    for tier in (GPUTier, OffHostTier):
        config = {"data_dir": str(tmp_path / tier.__name__), "cpu_bytes": 6 * CPUTier.slot_bytes(SPEC.page_bytes),
                  "disk_bytes": 1 << 20, "cpu_codec": cpu_codec, "disk_codec": disk_codec}
        store = make_store(device_tier=tier, **config)
        got = []
        for tokens, kv in _sequences():
            store.store("m", tokens, kv)
        for tokens, _ in _sequences() + _sequences()[::-1]:
            got.append((store.lookup("m", tokens).tiers, store.fetch("m", tokens).kv.view(torch.int16)))
        assert store.flush(FLUSH_S)
        store.close()
        reopened = make_store(device_tier=tier, **config)
        got += [(None, reopened.fetch("m", tokens).kv.view(torch.int16)) for tokens, _ in _sequences()]
        answers[tier] = got
    for (tiers, kv), (ref_tiers, ref_kv) in zip(answers[GPUTier], answers[OffHostTier], strict=True):
        assert tiers == ref_tiers and torch.equal(kv, ref_kv)
