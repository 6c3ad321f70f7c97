"""bench/paged_copy.py at a tiny size, on vLLM's own CPU cache-write op: both scatters write the
same blocks and the gather reads the scattered KV back (the script stops otherwise), and every
row it prints is in its JSON. No assertion is on speed."""
from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm._custom_ops", reason="vLLM (CPU build) is not installed")

from bench import paged_copy  # noqa: E402


def test_paged_copy_rows_for_each_size(tmp_path, capsys) -> None:
    out = tmp_path / "paged_copy.json"
    assert paged_copy.main(["--tokens", "64", "256", "--repeats", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert [r["tokens"] for r in result["results"]] == [64, 256]
    for r in result["results"]:
        assert r["mb"] == pytest.approx(r["tokens"] * 46080 / 1e6)
        assert all(r[k] > 0 for k in ("memcpy_ms", "strided_ms", "writer_ms", "per_offset_ms", "gather_ms"))
    printed = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in printed[-2:]] == ["64", "256"]
