"""bench/blend_workload.py's prompts, and bench/blend_quality.py on the real model, small: with
the same number of tokens recomputed, CacheBlend's deviation rule comes closer to a full prefill
than no recompute at all and than tokens picked at random."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from bench import blend_quality
from bench.blend_workload import Workload, WorkloadConfig, needle_correct

pytestmark = pytest.mark.heavy  # the real model through bench/blend_quality.py

# Short documents, so a prompt costs a few seconds of prefill on a CPU.
SMALL = ["--doc-tokens", "30,60", "--docs-per-prompt", "3,3", "--prompt-tokens", "120,260"]


@pytest.fixture(scope="module")
def tokenizer():
    from kvstore.decode.model_pull import pull
    from kvstore.decode.tokenizer import Tokenizer

    return Tokenizer.from_dir(pull("smollm2"))


@pytest.fixture(scope="module")
def workload(tokenizer):
    return Workload(tokenizer, WorkloadConfig(prompts=40, seed=7))


def test_prompts_are_seeded_real_text_with_documents_recurring_elsewhere(tokenizer, workload):
    prompts = workload.prompts()
    assert [p.tokens for p in prompts] == [p.tokens for p in Workload(tokenizer, workload.config).prompts()]
    assert all(200 <= len(d.tokens) <= 600 for d in workload.documents)
    assert all(1000 <= len(p.tokens) <= 6000 and 3 <= len(p.chunks) <= 8 for p in prompts)
    assert "assert" in tokenizer.decode([t for p in prompts for c in p.chunks for t in c]).lower()
    places = defaultdict(set)  # chunk -> the positions it starts at
    for p in prompts:
        at = len(p.prefix)
        for chunk in p.chunks:
            places[tuple(chunk)].add(at)
            at += len(chunk)
    assert sum(len(starts) > 1 for starts in places.values()) >= 10


def test_needles_are_planted_once_and_checked_exactly(tokenizer, workload):
    needles = [p for p in workload.prompts() if p.needle_answer is not None]
    assert 10 <= len(needles) <= 30
    for p in needles:
        texts = [tokenizer.decode(c) for c in p.chunks]
        assert [p.needle_answer in t for t in texts].count(True) == 1 and p.needle_answer in texts[p.needle_doc]
        assert "review number" in p.question_text
    assert needle_correct("It is 4,817.", "4817") and needle_correct("4817", "4817")
    assert not needle_correct("48170", "4817") and not needle_correct("no number", "4817")


def test_bad_workload_settings_name_the_field():
    with pytest.raises(ValueError, match="doc_tokens"):
        WorkloadConfig(doc_tokens=(600, 200))
    with pytest.raises(ValueError, match="pool_docs"):
        WorkloadConfig(pool_docs=2)
    with pytest.raises(SystemExit) as exit_:
        blend_quality.main(["--ratios", "0,1.5"])
    assert exit_.value.code == 2


def test_deviation_beats_no_recompute_and_random_tokens_on_the_real_model(tmp_path: Path, capsys):
    out, png = tmp_path / "blend.json", tmp_path / "blend.png"
    assert blend_quality.main(["--prompts", "2", "--seed", "3", "--ratios", "0,0.15", "--rules", "deviation,random",
                               "--answer-tokens", "8", "--ttft-lengths", "", *SMALL,
                               # this process's own thread count: a make test worker has one CPU,
                               # which two threads would only take turns on
                               "--threads", str(torch.get_num_threads()),
                               "--json", str(out), "--plot", str(png)]) == 0
    v = json.loads(out.read_text())["quality"]["variants"]
    blend, r0, random_ = v["deviation@0.15"], v["deviation@0"], v["random@0.15"]
    assert blend["recomputed_fraction"] == random_["recomputed_fraction"] > 0.1  # the same budget
    assert r0["recomputed_fraction"] == 0 and r0["kl"] > 0  # no recompute is not a full prefill
    assert blend["kl"] <= 0.5 * r0["kl"] and blend["kl"] < random_["kl"]
    assert "deviation" in capsys.readouterr().out and png.read_bytes()[:4] == b"\x89PNG"
