"""Start, kill and restart a real `kvstore serve` subprocess (the user's process, not an app in
the test's own interpreter): what SIGKILL, restarts and the startup line are checked against."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
START_TIMEOUT_S = 60.0


class SidecarFailed(RuntimeError):
    """The sidecar did not print its startup line (it exited or hung); carries its stderr."""


class Sidecar:
    """One `kvstore serve` process on a free port; `args` are extra serve flags."""

    def __init__(self, data_dir: Path | str, args: list[str], *, env: dict[str, str] | None = None):
        self.data_dir = str(data_dir)
        self.args = args
        self.env = {**os.environ, "PYTHONPATH": str(REPO), **(env or {})}
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.stderr_lines: list[str] = []

    def start(self) -> "Sidecar":
        self.stderr_lines = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", "serve", "--data-dir", self.data_dir, "--port", "0", *self.args],
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env, cwd=REPO)
        threading.Thread(target=self._drain_stderr, args=(self.proc,), daemon=True).start()
        line = _readline(self.proc, START_TIMEOUT_S)
        if "serving on http://" not in line:
            self.kill()
            raise SidecarFailed(f"kvstore serve did not start ({line!r}): {''.join(self.stderr_lines)[-2000:]}")
        self.url = line.split("serving on ", 1)[1].split()[0]
        return self

    def _drain_stderr(self, proc: subprocess.Popen[str]) -> None:
        assert proc.stderr is not None
        for line in proc.stderr:  # a full stderr pipe would block the sidecar
            self.stderr_lines.append(line)

    @property
    def stderr(self) -> str:
        return "".join(self.stderr_lines)

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs, exactly like an OOM kill or a power cut of the process."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def stop(self) -> int:
        """SIGTERM and wait: the graceful path."""
        assert self.proc is not None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.kill()
        return self.proc.returncode

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int:
        assert self.proc is not None
        return self.proc.pid


def _readline(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The first stdout line, or "" if none comes within `timeout_s` (the reader thread is left
    to die with the pipe)."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(timeout_s)
    return box[0] if box else ""
