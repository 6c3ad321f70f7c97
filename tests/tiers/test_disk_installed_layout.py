"""The disk tier's start check runs in a child process, which must import the same kvstore as the
parent in an installed layout too (one `kvstore/` folder holding api/, tiers/, ...), where the
package folder itself must never be on the child's path: its modules would shadow any of the
same name (the standard library's), the child could die, and every healthy disk tier would be
moved aside as damaged."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]

SCRIPT = """
import os, sys, torch
import kvstore
from kvstore import KVStore, ModelSpec, StoreConfig
assert kvstore.__file__.startswith(sys.argv[1]), kvstore.__file__
spec = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=8, page_size=4)
data = sys.argv[2]
kv = torch.arange(2 * 8 * 8, dtype=torch.float16).reshape(spec.kv_shape(8))
with KVStore(StoreConfig(data_dir=data, cpu_bytes=0, disk_bytes=8 << 20)) as s:
    s.register_model("m", spec)
    s.store("m", list(range(8)), kv)
with KVStore(StoreConfig(data_dir=data, cpu_bytes=0, disk_bytes=8 << 20)) as s:
    got = s.fetch("m", list(range(8)))
    print(got.matched_tokens, torch.equal(got.kv, kv), sorted(os.listdir(data)))
"""


def test_reopened_disk_tier_is_served_from_an_installed_layout(tmp_path):
    site = tmp_path / "site"
    shutil.copytree(REPO / "kvstore", site / "kvstore", ignore=shutil.ignore_patterns("__pycache__"))
    for folder in ("api", "tiers", "gpu", "decode"):  # where pyproject's package_dir installs them
        shutil.copytree(REPO / folder, site / "kvstore" / folder, ignore=shutil.ignore_patterns("__pycache__"))
    env = {**os.environ, "PYTHONPATH": str(site)}
    proc = subprocess.run([sys.executable, "-c", SCRIPT, str(site), str(tmp_path / "data")], cwd=tmp_path,
                          env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-2000:]
    matched, exact, entries = proc.stdout.split(" ", 2)
    assert (matched, exact) == ("8", "True")
    assert "corrupt" not in entries, entries  # nothing was moved aside as damaged
