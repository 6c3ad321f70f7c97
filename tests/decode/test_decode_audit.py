"""Audited reuse in the decode loop (`generate(..., audit_rate=)`): a sampled hit computes its last
full page and compares it with the stored one; a failure drops the path in the store and the
request prefills its whole prompt, so its answer is its own full prefill's. The real model's
fault cases are tests/reliability/test_rel_audit.py."""
from __future__ import annotations

import pytest

from kvstore import KVStore, StoreConfig
from kvstore.decode import generate, tiny_model
from kvstore.decode.reuse import PrefixReuse


@pytest.fixture(scope="module")
def model():
    return tiny_model(seed=3)


def _store() -> KVStore:
    return KVStore(StoreConfig(data_dir=None, cpu_bytes=8 << 20, disk_bytes=0))


def test_a_clean_hit_passes_and_reuses_all_but_the_audited_page(model):
    prompt = list(range(10, 80))  # 70 tokens: 4 full pages
    with _store() as store:
        generate(model, prompt, 1, backend=store)
        follow = prompt + [5, 6, 7]
        result = generate(model, follow, 4, backend=store, audit_rate=1.0, stop_token_ids=())
        assert result.audit is not None and result.audit.passed, result.audit
        assert result.reused_tokens == 48  # pages 0-2; page 3 (48..63) computed and compared
        assert result.tokens == generate(model, follow, 4, stop_token_ids=()).tokens
        assert store.stats()["audits"] == {model.name: {"cpu": {"passes": 1, "failures": 0}}}
        # Off (the default): no audit, the whole match reused.
        plain = generate(model, follow, 1, backend=store)
        assert plain.audit is None and plain.reused_tokens == 72


def test_a_wrong_page_fails_is_dropped_and_the_request_answers_as_its_full_prefill(model, caplog):
    prompt = list(range(100, 170))
    with _store() as store:
        generate(model, prompt, 1, backend=store)
        # Another prompt's KV served under this prompt's key: a collision of every page.
        other = generate(model, list(range(300, 370)), 1, backend=store)
        assert other.stored_tokens == 70
        kv = store.fetch(model.name, list(range(300, 370))).kv
        store.drop_model(model.name)
        store.register_model(model.name, model.spec)
        store.store(model.name, prompt, kv)
        follow = prompt + [1, 2]
        with caplog.at_level("ERROR", logger="kvstore.audit"):
            result = generate(model, follow, 4, backend=store, audit_rate=1.0, stop_token_ids=(), store=False)
        assert result.audit is not None and not result.audit.passed
        assert result.reused_tokens == 0 and result.computed_tokens == len(follow)
        assert result.tokens == generate(model, follow, 4, stop_token_ids=()).tokens
        assert store.lookup(model.name, prompt).matched_tokens == 0  # dropped
        assert store.stats()["audits"][model.name]["cpu"] == {"passes": 0, "failures": 1}
        line = next(r.getMessage() for r in caplog.records if "audit failed" in r.getMessage())
        assert f"model {model.name}" in line and "tenant default" in line and "tier cpu" in line
        assert "first failing layer" in line


def test_a_match_shorter_than_a_page_is_not_audited(model):
    with _store() as store:
        generate(model, list(range(1, 12)), 1, backend=store)
        result = generate(model, list(range(1, 14)), 1, backend=store, audit_rate=1.0)
        assert result.audit is None and result.reused_tokens == 11


def test_audit_rate_is_checked(model):
    with pytest.raises(ValueError, match=r"audit_rate: must be a number in \[0, 1\]"):
        generate(model, [1, 2, 3], 1, audit_rate=2.0)


def test_a_backend_without_report_audit_still_audits_and_recomputes(model):
    class NoReports:  # the KVStore surface minus report_audit, with every page's K zeroed
        def __init__(self, inner: KVStore):
            self.inner = inner

        def __getattr__(self, name):
            if name == "report_audit":
                raise AttributeError(name)
            return getattr(self.inner, name)

        def fetch(self, *args, **kwargs):
            result = self.inner.fetch(*args, **kwargs)
            result.kv[:, 0] = 0
            return result

    prompt = list(range(20, 60))
    with _store() as store:
        generate(model, prompt, 1, backend=store)
        backend = NoReports(store)
        assert not hasattr(backend, "report_audit") and isinstance(PrefixReuse(model, backend), PrefixReuse)
        result = generate(model, prompt + [3], 3, backend=backend, audit_rate=1.0, stop_token_ids=())
        assert result.audit is not None and not result.audit.passed and result.reused_tokens == 0
        assert result.tokens == generate(model, prompt + [3], 3, stop_token_ids=()).tokens
        # Nothing could tell the store: its pages stay (this backend's fetches keep zeroing K).
        assert store.lookup(model.name, prompt).matched_tokens == 40
        assert store.stats()["audits"] == {}
