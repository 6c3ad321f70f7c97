"""bench/blend_workload.py's prompts (both workloads), and bench/blend_quality.py on the real
model, small, on each workload: with the same number of tokens recomputed, CacheBlend's rule comes
closer to a full prefill than no recompute at all and than its controls."""
from __future__ import annotations

import json
from collections import defaultdict
from pathlib import Path

import pytest
import torch

from bench import blend_quality
from bench.blend_packages import PackageDocs, distributions, paragraphs_of, sameness
from bench.blend_workload import Workload, WorkloadConfig, needle_correct
from bench.research import blend_levers

pytestmark = pytest.mark.heavy  # the real model through bench/blend_quality.py

# Short documents, so a prompt costs a few seconds of prefill on a CPU.
SMALL = {"langref": ["--doc-tokens", "30,60", "--docs-per-prompt", "3,3", "--prompt-tokens", "120,260"],
         "packages": ["--doc-tokens", "30,80", "--docs-per-prompt", "3,3", "--prompt-tokens", "120,300"]}


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


def test_package_workload_is_the_installed_packages_text_with_other_questions(tokenizer):
    installed = distributions()
    assert {"torch", "numpy", "aiohttp", "pytest"} <= set(installed) and "kvstore" not in installed
    config = WorkloadConfig.named("packages", prompts=40, seed=7)
    assert (config.doc_tokens, config.docs_per_prompt) == ((80, 700), (2, 10))
    workload = Workload(tokenizer, config)
    prompts = workload.prompts()
    assert [p.tokens for p in prompts] == [p.tokens for p in Workload(tokenizer, config).prompts()]
    assert all(80 <= len(d.tokens) <= 700 for d in workload.documents)
    assert all(1000 <= len(p.tokens) <= 6000 and 2 <= len(p.chunks) <= 10 for p in prompts)
    titles = {d.title.split(" (part")[0] for d in workload.documents}
    assert any("package description" in t for t in titles) and any("LICENSE" in t.upper() for t in titles)
    grant = ("Permission is hereby granted, free of charge, to any person obtaining a copy of this software and "
             "associated documentation files")
    assert sameness(["MIT License", "Copyright (c) 2020 Ada", grant]) == sameness(["Copyright 2011 Bo", grant])
    assert sameness(["Copyright 2011 Bo", grant]) != sameness(["Copyright 2011 Bo", grant.replace("free", "a fee")])
    keys = [sameness(paragraphs) for _, paragraphs in PackageDocs().texts()]
    assert len(keys) == len(set(keys))
    readme = ('<h1 align="center">Tool</h1>\n<p align="center">\n<a href="x"><img src="https://img.shields.io/b.svg">'
              '</a>\n</p>\n\n[![CI](https://x/badge.svg)](https://x)\n.. image:: https://x/logo.png\n   :target: x\n\n'
              'Tool parses <b>bold</b> claims.\n\n    print("<p>")\n')
    assert paragraphs_of(readme) == ['<h1 align="center">Tool</h1>', "Tool parses <b>bold</b> claims.",
                                     '    print("<p>")']  # lines of markup alone go; lines with text stay
    needles = [p for p in prompts if p.needle_answer is not None]
    assert 10 <= len(needles) <= 30
    for p in needles:
        found = [p.needle_answer in tokenizer.decode(c) for c in p.chunks]
        assert found[p.needle_doc] and "review number" not in p.question_text
    assert len({p.question_text.split()[0] for p in prompts}) >= 4  # several question forms
    assert PackageDocs().max_pieces == 5


def test_bad_workload_settings_name_the_field():
    with pytest.raises(ValueError, match="doc_tokens"):
        WorkloadConfig(doc_tokens=(600, 200))
    with pytest.raises(ValueError, match="pool_docs"):
        WorkloadConfig(pool_docs=2)
    with pytest.raises(ValueError, match="workload"):
        WorkloadConfig.named("novels")
    for levers in (["--variants", "x:colour=red"], ["--rules", "rule,best"], ["--rules-at", "high:rule"]):
        with pytest.raises(SystemExit) as exit_:
            blend_levers.main(levers)
        assert exit_.value.code == 2
    with pytest.raises(SystemExit) as exit_:
        blend_quality.main(["--variants", "x:score=pooled"])  # the levers are the research tool's
    assert exit_.value.code == 2
    with pytest.raises(SystemExit) as exit_:
        blend_quality.main(["--ratios", "0,1.5"])
    assert exit_.value.code == 2


def run_small(workload: str, *more: str, main=blend_quality.main) -> int:
    """bench/blend_quality.py (or `main`, which passes its options on to it) on two short prompts of
    `workload`: r = 0 and r = 0.15, the rule and both controls, an 8-token answer."""
    return main(["--workload", workload, "--prompts", "2", "--seed", "3", "--ratios", "0,0.15",
                               "--answer-tokens", "8", "--ttft-lengths", "", *SMALL[workload],
                               "--reference-dir", "",
                               # this process's own thread count: a make test worker has one CPU,
                               # which two threads would only take turns on
                               "--threads", str(torch.get_num_threads()), *more])


@pytest.fixture(scope="module")
def langref_run(tmp_path_factory) -> Path:
    """The small langref run in one go: the rule's test reads it, and the resumed run must equal it."""
    out = tmp_path_factory.mktemp("blend-langref") / "blend.json"
    assert run_small("langref", "--json", str(out)) == 0
    return out


@pytest.mark.parametrize("workload", ["langref", "packages"])
def test_rule_beats_no_recompute_and_its_controls_on_the_real_model(workload: str, request, tmp_path: Path, capsys):
    if workload == "langref":
        out = request.getfixturevalue("langref_run")
    else:
        out, png = tmp_path / "blend.json", tmp_path / "blend.png"
        assert run_small(workload, "--json", str(out), "--plot", str(png)) == 0
        assert "rule" in capsys.readouterr().out and png.read_bytes()[:4] == b"\x89PNG"
    v = json.loads(out.read_text())["quality"]["variants"]
    blend, r0, random_, first = v["rule@0.15"], v["none@0"], v["random@0.15"], v["first@0.15"]
    assert blend["recomputed_fraction"] == random_["recomputed_fraction"] == first["recomputed_fraction"] > 0.1
    assert r0["recomputed_fraction"] == 0 and r0["kl"] > 0  # no recompute is not a full prefill
    assert blend["kl"] <= 0.5 * r0["kl"] and blend["kl"] < random_["kl"]


def test_a_resumed_run_equals_one_run_and_refuses_another_config(langref_run: Path, tmp_path: Path, capsys):
    split = tmp_path / "split.json"
    assert run_small("langref", "--prompts", "1", "--resume", str(split)) == 0
    first_part = json.loads(split.read_text())["quality"]["per_prompt"]
    assert run_small("langref", "--resume", str(split)) == 0  # the second prompt only
    one, two = json.loads(langref_run.read_text())["quality"], json.loads(split.read_text())["quality"]
    assert [p["index"] for p in two["per_prompt"]] == [0, 1] and two["per_prompt"][:1] == first_part
    assert two["variants"] == one["variants"] and two["variants"]["rule@0.15"]["prompts"] == 2
    assert {k: v for k, v in two.items() if k in ("needle_full", "mean_prompt_tokens", "chunks_per_prompt")} == \
        {k: v for k, v in one.items() if k in ("needle_full", "mean_prompt_tokens", "chunks_per_prompt")}
    capsys.readouterr()
    for other, named in ((["--seed", "4"], "workload.seed"), (["--answer-tokens", "9"], "answer_tokens"),
                         (["--ratios", "0,0.3"], "variants")):
        with pytest.raises(SystemExit) as exit_:
            run_small("langref", *other, "--resume", str(split))
        assert exit_.value.code == 2 and named in capsys.readouterr().err
    assert json.loads(split.read_text())["quality"] == two  # a refused run leaves the file as it was


def test_the_research_tool_runs_its_selections_beside_the_rule_at_equal_recompute(tmp_path: Path):
    out = tmp_path / "levers.json"
    assert run_small("langref", "--rules", "rule", "--variants", "L2:select_layer=2", "--json", str(out),
                     main=blend_levers.main) == 0
    v = json.loads(out.read_text())["quality"]["variants"]
    assert set(v) == {"none@0", "rule@0.15", "L2@0.15"}
    # Selecting on layer 2 sends every token through layers 0-1: the same r, more work.
    assert v["L2@0.15"]["recomputed_fraction"] == v["rule@0.15"]["recomputed_fraction"] > 0.1
    assert v["L2@0.15"]["layer_work"] > v["rule@0.15"]["layer_work"]
