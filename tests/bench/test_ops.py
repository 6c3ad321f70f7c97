"""bench/ops.py at tiny sizes: every case comes out, its ratios are the
ones its own figures give, each target is judged as its value says, and the disk cases really
read the disk. No assertion is on speed."""
from __future__ import annotations

import json

import pytest

from bench import ops


def test_ops_in_process_and_disk_cases(tmp_path, capsys) -> None:
    out = tmp_path / "ops.json"
    assert ops.main(["--quick", "--rounds", "1", "--seconds", "0.01", "--big-mib", "2",
                     "--paths", "in-process,disk", "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    names = [r["name"] for r in result["rows"]]
    assert names == ["in-process: fetch 64 KiB", "in-process: store 64 KiB", "in-process: fetch 2 MiB",
                     "in-process: fetch into 2 MiB", "in-process: store 2 MiB",
                     "disk only: fetch 2 MiB", "cpu+disk: fetch 2 MiB"]
    for r in result["rows"]:
        assert r["calls"] >= 2 * 8 and 0 < r["p50_us"] <= r["p90_us"]
        assert r["speed_vs_memcpy"] == pytest.approx(r["memcpy_us"] / r["p50_us"])
        assert r["cost_vs_dict"] == pytest.approx(r["p50_us"] / r["dict_us"])
        # The memcpy that counts is the faster of those measured for the case.
        measured = [r["baselines_p50_us"][k] for k in ("memcpy", "memcpy-fresh") if k in r["baselines_p50_us"]]
        assert r["memcpy_us"] == min(measured)
        assert ("memcpy-fresh" in r["baselines_p50_us"]) == (r["op"] == "fetch")
        for t in r["targets"]:
            bound = float(t["target"].split()[-1])
            assert t["met"] == (t["value"] <= bound if t["target"].startswith("cost") else t["value"] >= bound)
        assert f"| {r['path']} | {r['op']} |" in printed
    targets = {r["name"]: [t["target"] for t in r["targets"]] for r in result["rows"]}
    assert targets["in-process: fetch 64 KiB"] == ["cost vs dict <= 3"]
    assert targets["in-process: store 64 KiB"] == ["cost vs dict <= 4"]
    assert targets["in-process: fetch into 2 MiB"] == ["speed vs memcpy >= 0.7"]
    assert targets["disk only: fetch 2 MiB"] == ["speed vs memcpy >= 0.5"]
    for name in ("disk only: fetch 2 MiB", "cpu+disk: fetch 2 MiB"):
        note = next(r["note"] for r in result["rows"] if r["name"] == name)
        assert "4.00 disk pages read per fetch" in note
    assert result["kvstore"].endswith("kvstore")


def test_ops_bad_arguments_name_the_option(capsys) -> None:
    with pytest.raises(SystemExit):
        ops.main(["--paths", "gpu"])
    assert "--paths" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        ops.main(["--big-mib", "1"])
    assert "--big-mib" in capsys.readouterr().err
