"""`make install` picks the CuPy extra by the driver's CUDA (nvidia-smi's "CUDA Version"), and
brings NVRTC everywhere. Checked with `make -n` (print, run nothing) and a stand-in nvidia-smi
ahead of any real one on PATH."""
from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _install_line(tmp_path: Path, cuda_version: str | None) -> str:
    """The recipe's install line with a stand-in nvidia-smi first on PATH: one that reports
    `cuda_version`, or (None) one that fails and prints nothing, as where there is no driver."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    smi = bin_dir / "nvidia-smi"
    if cuda_version is None:
        smi.write_text("#!/bin/sh\nexit 9\n")
    else:
        banner = f"| NVIDIA-SMI 580.65   Driver Version: 580.65   CUDA Version: {cuda_version}   |"
        smi.write_text(f"#!/bin/sh\necho '{banner}'\n")
    smi.chmod(0o755)
    venv = tmp_path / "venv"
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}"}
    out = subprocess.run(["make", "-n", "-B", f"VENV={venv}", f"{venv}/.installed"], cwd=ROOT, text=True,
                         capture_output=True, env=env, check=True).stdout
    lines = [line for line in out.splitlines() if "install -q -e" in line]
    assert len(lines) == 1, out
    return lines[0]


@pytest.mark.skipif(shutil.which("make") is None, reason="make is not installed")
@pytest.mark.parametrize("cuda_version,extras", [("13.0", "dev,gpu"), ("13.2", "dev,gpu"), ("12.4", "dev,gpu-cuda12"),
                                                 ("11.8", "dev"), (None, "dev")])
def test_make_install_picks_the_cupy_for_the_driver(tmp_path: Path, cuda_version: str | None, extras: str) -> None:
    line = _install_line(tmp_path, cuda_version)
    assert f'".[{extras}]"' in line
    assert "nvidia-cuda-nvrtc" in line  # the kernels compile in `make test` on every machine
