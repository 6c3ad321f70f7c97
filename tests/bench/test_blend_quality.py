"""bench/blend_quality.py's task and committed model: the task needs earlier chunks, the model
(loaded through decode/loader.py) answers it with a full prefill and fails with standalone chunk
KV, and the benchmark's evaluation runs end to end on a few questions."""
from __future__ import annotations

import json
import random
from pathlib import Path

from bench import blend_quality, blend_task as task


def test_questions_need_an_earlier_chunk_and_answers_are_unambiguous():
    rng = random.Random(0)
    pool = [task.make_chunk(rng) for _ in range(40)]
    for _ in range(50):
        ex = task.make_example(rng, pool, 4)
        marker = ex.question[1] - task.QUERY0 + task.MARKER0
        prompt = ex.prompt
        at = prompt.index(marker)
        assert prompt.count(marker) == 1 and task.answer_at(prompt, at) == ex.answer
        start = next(s for s in [len(ex.prefix) + sum(map(len, ex.chunks[:i])) for i in range(4)][::-1] if s <= at)
        own = prompt[start:at]
        # Within its own chunk the marker cannot see its answer: it needs what came before.
        assert not any(map(task.is_value, own)) or task.answer_at(prompt[start:], at - start) != ex.answer


def test_evaluation_runs_on_the_committed_model(tmp_path: Path, capsys):
    out = tmp_path / "blend.json"
    assert blend_quality.main(["--questions", "40", "--no-ttft", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    acc = report["quality"]["accuracy"]
    assert acc["full"] >= 0.6 and acc["full"] - acc["reuse"] >= 0.2  # the model needs cross-chunk KV
    assert abs(acc["blend@0.15"] - acc["full"]) <= 0.1
    assert "blend@0.15" in capsys.readouterr().out
