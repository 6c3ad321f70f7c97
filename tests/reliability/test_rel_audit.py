"""Audited reuse on the real model (SmolLM2-135M-Instruct, float32), small: the fault kinds users
meet, placed in the page the audit withholds, are caught on the first audited hit; the
path is dropped; the audited request and the next one answer as their own full prefill, and a
later hit on the recomputed pages passes. `python bench/chaos.py --only audit` runs every fault in
both places and both dtypes, and the clean hits behind the tolerance (bench/reliability/audit.py)."""
from __future__ import annotations

import random

import pytest

from bench.reliability.audit import real_text, run_fault
from kvstore.decode import generate

pytestmark = pytest.mark.heavy  # the real model


@pytest.fixture(scope="module")
def text(smollm2_model):
    return real_text(smollm2_model, max_chars=40_000)


# Two kinds in `make test` (a page of another prompt under the key, another checkpoint's pages);
# all five with `pytest -m slow` (each costs a few real-model prefills).
ALL_KINDS = [pytest.param(kind, marks=() if kind in ("collision", "weights-1.01") else pytest.mark.slow)
             for kind in ("slot-bytes", "weights-1.01", "k-no-rope", "heads-permuted", "collision")]


@pytest.mark.parametrize("fault", ALL_KINDS)
def test_a_fault_in_the_audited_page_is_caught_dropped_and_recomputed(smollm2_model, text, fault):
    case = run_fault(smollm2_model, text, fault, "audited page", random.Random(fault), prompt_tokens=48,
                     new_tokens=2)
    assert case.detected and case.first_layer is not None and case.worst > case.tolerance, case
    assert case.left_tokens == 0, case  # the store no longer matches the prompt
    assert case.audited_answer_ok and case.next_recomputed and case.next_answer_ok, case
    assert case.later_passed and case.later_answer_ok, case


def test_a_clean_chunk_hit_passes_its_audit_on_the_real_model(smollm2_model, text):
    """CacheBlend: a stored chunk blended after a prefix (so its K is re-rotated there) is
    audited, rotated back to where the store keeps it, against the engine's own standalone
    computation, and passes."""
    from bench.reliability.audit import new_store

    model = smollm2_model
    chunk, prefix, question = text[1000:1040], text[2000:2019], text[3000:3005]  # 2 full pages + 8
    with new_store() as store:
        first = generate(model, question, 2, backend=store, prefix=prefix, chunks=[chunk], stop_token_ids=())
        audited = generate(model, question, 2, backend=store, prefix=prefix, chunks=[chunk], stop_token_ids=(),
                           audit_rate=1.0)
    assert first.chunk_hits == [False] and audited.chunk_hits == [True]
    assert len(audited.chunk_audits) == 1 and audited.chunk_audits[0].passed, audited.chunk_audits
    assert audited.tokens == first.tokens
