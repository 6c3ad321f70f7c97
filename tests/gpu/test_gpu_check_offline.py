"""bench/gpu_check.sh on a machine without a GPU: its offline install (bench/offline_stage.py) makes
the working tree importable as `kvstore` (kvstore.gpu included) and unpacks the carried wheels this
interpreter lacks, with no network and nothing installed; then it stops at "no CUDA device",
saying so, with exit status 3 and no traceback. On a machine with CUDA the script runs whole
instead (minutes): this test is for the machines without."""
from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _wheel(directory: Path, name: str, tags: str, files: dict[str, str]) -> Path:
    """A minimal wheel (PEP 427) holding `files`."""
    path = directory / f"{name}-1.0-{tags}.whl"
    dist_info = f"{name}-1.0.dist-info"
    with zipfile.ZipFile(path, "w") as archive:
        for file, text in files.items():
            archive.writestr(file, text)
        archive.writestr(f"{dist_info}/METADATA", f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
        archive.writestr(f"{dist_info}/WHEEL", f"Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: {tags}\n")
        archive.writestr(f"{dist_info}/RECORD", "")
    return path


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: bench/gpu_check.sh runs in full here")
def test_offline_install_imports_the_tree_and_stops_at_no_cuda_device(tmp_path: Path) -> None:
    wheels = tmp_path / "wheels"
    wheels.mkdir()
    _wheel(wheels, "kvprobe_carried", "py3-none-any", {"kvprobe_carried/__init__.py": "VALUE = 7\n"})
    _wheel(wheels, "kvprobe_foreign", "cp27-cp27m-win32", {"kvprobe_foreign/__init__.py": ""})
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(PYTHON=sys.executable, WHEELS=str(wheels))
    run = subprocess.run(["bash", str(ROOT / "bench" / "gpu_check.sh"), str(out)], cwd=tmp_path, env=env,
                         capture_output=True, text=True, timeout=240)
    printed = run.stdout + run.stderr
    assert run.returncode == 3, printed
    assert "gpu_check: no CUDA device:" in printed and "Traceback" not in printed and "AssertionError" not in printed
    lines = printed.splitlines()
    # The tree, staged as the package: the repository's gpu/ is kvstore.gpu.
    stage_lines = [line for line in lines if line.startswith("offline_stage: import kvstore.gpu: ")]
    assert len(stage_lines) == 1 and stage_lines[0].endswith("/kvstore/gpu/__init__.py"), printed
    stage = Path(stage_lines[0].split(": ", 2)[2]).parents[2]
    assert stage.name.startswith("kvstore-gpu-check.") and not stage.exists()  # a temporary folder, removed
    # A carried wheel this interpreter lacks is unpacked and imports from the stage; one for
    # another platform is left out, saying why.
    assert any(line.startswith("offline_stage: unpacked kvprobe_carried-1.0") for line in lines), printed
    assert f"offline_stage: import kvprobe_carried: {stage}/kvprobe_carried/__init__.py" in lines, printed
    assert any(line.startswith("offline_stage: skipped kvprobe_foreign-1.0") for line in lines), printed
    written = sorted(p.name for p in out.iterdir())
    assert written == ["gpu_check.log", "summary.txt"] and len(written) <= 8
    assert "device: none (no CUDA device); stopped" in (out / "summary.txt").read_text()
    assert (out / "gpu_check.log").read_text().strip().endswith("device: none (no CUDA device); stopped")
