"""Audited reuse of CacheBlend's chunks (`generate(..., chunks=, audit_rate=)`): a sampled chunk hit
rotates the KV blend answered back to positions 0..n-1, recomputes its last full page standalone
there and compares it with the stored page; a failure drops the chunk in the store and the request computes the chunk
standalone, so it answers as a blend that missed the chunk. The real model's figures and fault
table are bench/reliability/audit.py `run_chunk_clean` / `run_chunk_faults` (docs/reliability.md)."""
from __future__ import annotations

import random

import pytest
import torch

from bench.reliability.audit import cpu_slot
from kvstore import KVStore, StoreConfig
from kvstore.decode import generate, tiny_model

NEW = 4


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


@pytest.fixture
def store():
    with KVStore(StoreConfig(data_dir=None, cpu_bytes=8 << 20, disk_bytes=0)) as s:
        yield s


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


PREFIX, QUESTION = ids(1, 5), ids(2, 4)
LONG, SHORT, OTHER = ids(3, 40), ids(4, 10), ids(5, 33)  # 2 full pages + 8; under a page; 2 full pages + 1


def blend(model, backend, chunks, **kwargs):
    return generate(model, QUESTION, NEW, backend=backend, prefix=PREFIX, chunks=chunks, stop_token_ids=(), **kwargs)


def test_a_clean_chunk_hit_passes_and_is_reused_as_blend_answered_it(model, store):
    chunks = [LONG, SHORT, OTHER]
    blend(model, store, chunks)  # computes and stores the chunks
    result = blend(model, store, chunks, audit_rate=1.0)
    assert result.chunk_hits == [True, True, True]
    assert len(result.chunk_audits) == 2 and all(a.passed for a in result.chunk_audits)  # SHORT: under a page
    assert result.tokens == blend(model, store, chunks).tokens  # the audit changes nothing of the answer
    assert store.stats()["audits"] == {model.name: {"cpu": {"passes": 2, "failures": 0}}}
    assert result.summary().count("chunk audit passed") == 2
    assert result.audit is None  # no prefix audit in a blend


def test_a_chunk_with_changed_bytes_fails_is_dropped_and_computed_standalone(model, store, caplog):
    chunks = [OTHER, LONG]
    blend(model, store, chunks)
    slot = cpu_slot(store, model, LONG, 0, chunk=True)  # an earlier page: reaches the audited one by attention
    slot[1000:1256] = torch.randint(0, 256, (256,), dtype=torch.uint8, generator=torch.Generator().manual_seed(7))
    with caplog.at_level("ERROR", logger="kvstore.audit"):
        result = blend(model, store, chunks, audit_rate=1.0, store=False)
    assert result.chunk_hits == [True, False]
    assert [a.passed for a in result.chunk_audits] == [True, False]
    # The answer of a blend that missed LONG: with no store every chunk is computed standalone,
    # and OTHER's stored KV is what its standalone computation gives.
    assert result.tokens == blend(model, None, chunks).tokens
    assert result.reused_tokens == len(PREFIX) - 1 + len(OTHER)  # the prefix's stored pages, and OTHER
    assert store.blend(model.name, [LONG, OTHER]).hits == [False, True]  # the chunk's pages are dropped
    assert store.stats()["audits"][model.name]["cpu"] == {"passes": 1, "failures": 1}
    line = next(r.getMessage() for r in caplog.records if "audit failed" in r.getMessage())
    assert "matched chunk" in line and "tier cpu" in line and f"({len(LONG)} tokens)" in line
    # The next request computes and stores it fresh; a later audited hit on it passes.
    again = blend(model, store, chunks, audit_rate=1.0)
    assert again.chunk_hits == [True, False]
    later = blend(model, store, chunks, audit_rate=1.0)
    assert later.chunk_hits == [True, True] and all(a.passed for a in later.chunk_audits)
    assert later.tokens == result.tokens


def test_a_blend_answered_at_the_wrong_positions_fails(model, store):
    class OffByOne:  # a store whose re-rotation puts every chunk's K one position too far
        def __init__(self, inner: KVStore):
            self.inner = inner

        def __getattr__(self, name):
            return getattr(self.inner, name)

        def blend(self, model_name, chunks, *, start_pos=0, tenant=None):
            return self.inner.blend(model_name, chunks, start_pos=start_pos + 1, tenant=tenant)

    chunks = [LONG]
    blend(model, store, chunks)
    result = blend(model, OffByOne(store), chunks, audit_rate=1.0, store=False)
    assert result.chunk_hits == [False] and not result.chunk_audits[0].passed
    assert result.chunk_audits[0].first_failure == (0, "k")  # V has no rotation: K shows it at once
    assert result.tokens == blend(model, None, chunks).tokens


def test_audit_rate_zero_and_chunks_under_a_page_draw_nothing(model, store, monkeypatch):
    blend(model, store, [LONG, SHORT])

    def no_draw() -> float:
        raise AssertionError("drew a random number")

    monkeypatch.setattr(random, "random", no_draw)
    result = blend(model, store, [LONG, SHORT], audit_rate=0.0)
    assert result.chunk_hits == [True, True] and result.chunk_audits == ()
    short_only = blend(model, store, [SHORT], audit_rate=0.5)
    assert short_only.chunk_hits == [True] and short_only.chunk_audits == ()
    assert "audit" not in result.summary()
    assert store.stats()["audits"] == {}


def test_chunk_audits_through_the_sidecar(model):
    from kvstore.api.client import KVStoreClient
    from kvstore.api.server.in_process import InProcessSidecar

    with InProcessSidecar(StoreConfig(data_dir=None, cpu_bytes=8 << 20, disk_bytes=0)) as url, \
            KVStoreClient(url) as client:
        chunks = [LONG, OTHER]
        blend(model, client, chunks)
        clean = blend(model, client, chunks, audit_rate=1.0)
        assert clean.chunk_hits == [True, True] and all(a.passed for a in clean.chunk_audits)
        assert client.stats()["audits"] == {model.name: {"cpu": {"passes": 2, "failures": 0}}}
