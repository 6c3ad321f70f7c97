"""`kvstore serve` in a process of its own, for the vLLM connector's end-to-end tests.

It can be killed and started again on the same port and data directory, as a crashed and
restarted sidecar would be."""
from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

from bench.engines import free_port
from kvstore import KVStoreClient

__all__ = ["Sidecar", "free_port"]


class Sidecar:
    """A sidecar on loopback; `auth_file` maps bearer tokens to tenants, `default_token` is the
    one its health check sends (an authenticated sidecar answers nothing without one)."""

    def __init__(self, data_dir: Path, auth_file: Path | None = None, *, default_token: str | None = None,
                 cpu_bytes: str = "0", disk_bytes: str = "64MiB", extra_args: list[str] | None = None):
        self.data_dir, self.auth_file, self.port = data_dir, auth_file, free_port()
        self.default_token, self.cpu_bytes, self.disk_bytes = default_token, cpu_bytes, disk_bytes
        self.extra_args = list(extra_args or [])  # more `kvstore serve` flags
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        command = [sys.executable, "-m", "kvstore.cli", "serve", "--port", str(self.port),
                   "--data-dir", str(self.data_dir), "--cpu-bytes", self.cpu_bytes, "--disk-bytes", self.disk_bytes,
                   "--log-level", "warning", *self.extra_args]
        if self.auth_file is not None:
            command += ["--auth-file", str(self.auth_file)]
        self.proc = subprocess.Popen(command)
        deadline = time.monotonic() + 60
        with KVStoreClient(self.url, token=self.default_token, timeout_s=2) as client:
            while True:
                try:
                    if client.healthz():
                        return
                except Exception:
                    if time.monotonic() > deadline or self.proc.poll() is not None:
                        raise
                time.sleep(0.2)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(30)
            self.proc = None
