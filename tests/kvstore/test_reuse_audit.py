"""Audited reuse: the comparison and its tolerance (kvstore/reuse_audit.py), and the store's side
(kvstore/store_audit.py): counts per model and tier, a failure drops the matched path in every
tier, /metrics and stats, the sidecar's POST /v1/audit."""
from __future__ import annotations

import math

import pytest
import torch

from kvstore import KVStore, ModelSpec, StoreConfig
from kvstore.api.server.metrics import Metrics
from kvstore.errors import InvalidRequest
from kvstore.reuse_audit import (EPS_MULTIPLE, FLOAT32_FLOOR, audited_span, check_audit_rate, compare_page, deviation,
                                 sampled, tolerance_for)

SPEC = ModelSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)


def test_tolerance_is_a_multiple_of_the_dtypes_epsilon_with_a_float32_floor():
    assert tolerance_for(torch.bfloat16) == EPS_MULTIPLE * 2 ** -7
    assert tolerance_for(torch.float16) == EPS_MULTIPLE * 2 ** -10
    assert tolerance_for(torch.float32) == max(EPS_MULTIPLE * 2 ** -23, FLOAT32_FLOOR)


def test_deviation_is_relative_to_the_computed_layer_and_fails_what_is_not_finite():
    computed = torch.randn(4, 2, 8, generator=torch.Generator().manual_seed(0))
    assert deviation(computed, computed.clone()) == 0.0
    assert math.isclose(deviation(computed, computed * 1.01), 0.01, rel_tol=1e-4)
    broken = computed.clone()
    broken[1, 1, 3] = float("nan")
    assert deviation(computed, broken) == math.inf
    assert deviation(computed, computed[:3]) == math.inf  # a wrong shape never passes
    assert deviation(torch.zeros(2), torch.zeros(2)) == 0.0 and deviation(torch.zeros(2), torch.ones(2)) == math.inf


def test_compare_page_names_the_first_failing_layer_and_part():
    page = torch.randn(SPEC.kv_shape(4), generator=torch.Generator().manual_seed(1)).to(torch.bfloat16)
    noisy = page.float() * (1 + 2 ** -9)  # well under the tolerance: rounding-sized
    assert compare_page(noisy.to(torch.bfloat16), page).passed
    wrong = page.clone()
    wrong[1, 1] = wrong[1, 1].roll(1, dims=1)  # layer 1's V heads in the wrong order
    wrong[2, 0] = 0  # and layer 2's K gone
    outcome = compare_page(wrong, page)
    assert not outcome.passed and outcome.first_failure == (1, "v") and outcome.worst > outcome.tolerance
    assert "first failing layer 1 (V)" in outcome.describe()


def test_the_audited_span_is_the_last_full_page_before_the_prompts_last_token():
    assert audited_span(64, 16, 100) == (48, 64)
    assert audited_span(70, 16, 100) == (48, 64)  # a partial tail page is recomputed, not audited
    assert audited_span(64, 16, 64) == (32, 48)  # the last prompt token is always computed
    assert audited_span(15, 16, 100) is None


def test_audit_rate_is_a_probability():
    assert check_audit_rate(0) == 0.0 and check_audit_rate(1) == 1.0
    for bad in (-0.1, 1.5, True, "0.5", float("nan")):
        with pytest.raises(ValueError, match="audit_rate"):
            check_audit_rate(bad)
    assert not sampled(0.0) and sampled(1.0)


def _stored(store: KVStore, n: int, model: str = "m") -> list[int]:
    store.register_model(model, SPEC)
    tokens = list(range(1, n + 1))
    store.store(model, tokens, torch.randn(SPEC.kv_shape(n)).to(torch.float16))
    return tokens


def test_a_pass_is_counted_and_a_failure_drops_the_matched_path_everywhere(tmp_path):
    with KVStore(StoreConfig(data_dir=str(tmp_path), cpu_bytes=1 << 20, disk_bytes=8 << 20)) as store:
        tokens = _stored(store, 16)
        longer = tokens + [99, 98, 97, 96]
        store.store("m", longer, torch.zeros(SPEC.kv_shape(4), dtype=torch.float16), start=16)
        other = _stored(store, 8, model="other")
        assert store.report_audit("m", tokens, passed=True, tier="cpu").dropped_pages == 0
        assert store.lookup("m", longer).matched_tokens == 20
        report = store.report_audit("m", tokens[:12] + [5, 5], passed=False, tier="cpu", layer=3)
        assert report.dropped_pages == 5 and report.kept_pages == 0  # the 3 matched pages and what hangs below
        store.flush()
        assert store.lookup("m", longer).matched_tokens == 0
        assert store.lookup("other", other).matched_tokens == 8  # another model's pages stay
        stats = store.stats()
        assert stats["audits"] == {"m": {"cpu": {"passes": 1, "failures": 1}}}
        text = Metrics(store.stats).render().decode()
        assert 'kvstore_audit_failures_total{model="m",tier="cpu"} 1.0' in text
        assert 'kvstore_audit_passes_total{model="m",tier="cpu"} 1.0' in text
        with pytest.raises(InvalidRequest, match="tier: expected one of cpu, disk"):
            store.report_audit("m", tokens, passed=True, tier="elsewhere")
        with pytest.raises(InvalidRequest, match="passed"):
            store.report_audit("m", tokens, passed=1, tier="cpu")  # type: ignore[arg-type]
        with pytest.raises(InvalidRequest, match="layer"):
            store.report_audit("m", tokens, passed=False, tier="cpu", layer=-1)


def test_a_failed_audit_keeps_pages_another_request_holds_pinned():
    with KVStore(StoreConfig(data_dir=None, cpu_bytes=1 << 20, disk_bytes=0)) as store:
        tokens = _stored(store, 8)
        with store.fetch_pinned("m", tokens) as pinned:
            assert pinned.runs is not None
            report = store.report_audit("m", tokens, passed=False, tier="cpu")
            assert report.dropped_pages == 0 and report.kept_pages == 2
        assert store.stats()["audits"]["m"]["cpu"]["failures"] == 1


def test_the_sidecar_takes_audits_and_drops_the_path():
    from kvstore.api.client import KVStoreClient
    from kvstore.api.server.in_process import InProcessSidecar

    with InProcessSidecar(StoreConfig(data_dir=None, cpu_bytes=1 << 20, disk_bytes=0)) as url, \
            KVStoreClient(url) as client:
        tokens = _stored(client, 8)  # type: ignore[arg-type]
        assert client.report_audit("m", tokens, passed=True, tier="cpu").dropped_pages == 0
        assert client.report_audit("m", tokens, passed=False, tier="cpu", layer=0).dropped_pages == 2
        assert client.lookup("m", tokens).matched_tokens == 0
        assert client.stats()["audits"] == {"m": {"cpu": {"passes": 1, "failures": 1}}}
        with pytest.raises(InvalidRequest, match="tier"):
            client.report_audit("m", tokens, passed=True, tier="gpu")


def _chunk(store, n: int, model: str = "m") -> list[int]:
    store.register_model(model, SPEC)
    tokens = list(range(500, 500 + n))
    store.store_chunk(model, tokens, torch.randn(SPEC.kv_shape(n)).to(torch.float16))
    return tokens


def test_a_chunk_audit_drops_the_chunks_own_tree_and_names_its_tier():
    with KVStore(StoreConfig(data_dir=None, cpu_bytes=1 << 20, disk_bytes=0)) as store:
        chunk = _chunk(store, 10)
        prefix = _stored(store, 10)  # the same length under the prefix tree: not the chunk's path
        assert store.blend("m", [chunk]).hits == [True]
        # No tier: the store names the one holding the chunk's last full page.
        assert store.report_audit("m", chunk, passed=True, chunk=True).dropped_pages == 0
        report = store.report_audit("m", chunk, passed=False, layer=1, chunk=True)
        assert report.dropped_pages == 3 and report.kept_pages == 0  # 2 full pages and the tail
        assert store.blend("m", [chunk]).hits == [False]
        assert store.lookup("m", prefix).matched_tokens == 10  # the prefix tree stays
        assert store.stats()["audits"] == {"m": {"cpu": {"passes": 1, "failures": 1}}}
        with pytest.raises(InvalidRequest, match="chunk: expected true or false, got 1"):
            store.report_audit("m", chunk, passed=True, chunk=1)  # type: ignore[arg-type]


def test_the_sidecar_takes_chunk_audits_and_refuses_a_bad_chunk_value():
    import json
    import urllib.error
    import urllib.request

    from kvstore.api.client import KVStoreClient
    from kvstore.api.server.in_process import InProcessSidecar

    with InProcessSidecar(StoreConfig(data_dir=None, cpu_bytes=1 << 20, disk_bytes=0)) as url, \
            KVStoreClient(url) as client:
        chunk = _chunk(client, 8)  # type: ignore[arg-type]
        assert client.report_audit("m", chunk, passed=True, tier="cpu", chunk=True).dropped_pages == 0
        assert client.report_audit("m", chunk, passed=False, chunk=True).dropped_pages == 2
        assert client.blend("m", [chunk]).hits == [False]
        assert client.stats()["audits"] == {"m": {"cpu": {"passes": 1, "failures": 1}}}
        body = json.dumps({"model": "m", "tokens": chunk, "passed": True, "chunk": "yes"}).encode()
        request = urllib.request.Request(f"{url}/v1/audit", body, {"Content-Type": "application/json"})
        with pytest.raises(urllib.error.HTTPError) as refused:
            urllib.request.urlopen(request, timeout=10)
        assert refused.value.code == 400
        assert "chunk: expected true or false" in refused.value.read().decode()
        with pytest.raises(InvalidRequest, match="chunk"):
            client.report_audit("m", chunk, passed=True, chunk="yes")  # type: ignore[arg-type]
