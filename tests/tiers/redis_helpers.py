"""A throwaway redis-server for the Redis tier's tests: a free loopback port, its own temporary
directory, started and stopped by the test (killed, paused or restarted on the same port to
play faults). Skips the test with a reason when redis-server is not installed."""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time
from pathlib import Path

import pytest
import redis

REDIS_SERVER = shutil.which("redis-server")
REDIS_CLI = shutil.which("redis-cli")
NEEDS_REDIS = "redis-server is not installed (make system-deps / apt-get install redis-server)"


def free_port(bus: bool = False) -> int:
    """A free loopback port; `bus`: one whose cluster bus port (+10000) is free and valid too."""
    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if not bus:
            return port
        if port + 10000 <= 65535:
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port + 10000))
                    return port
                except OSError:
                    pass


class RedisServer:
    """One redis-server process. `url` stays the same across restart()."""

    def __init__(self, workdir: Path, port: int | None = None, *extra: str):
        if REDIS_SERVER is None:
            pytest.skip(NEEDS_REDIS)
        self.workdir = workdir
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port(bus="--cluster-enabled" in extra)
        self.extra = list(extra)
        self.proc: subprocess.Popen | None = None
        self.start()

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=5)

    def start(self) -> None:
        # No persistence: a restarted server is empty, as after a crash without RDB/AOF.
        args = [REDIS_SERVER, "--port", str(self.port), "--bind", "127.0.0.1", "--dir", str(self.workdir),
                "--save", "", "--appendonly", "no", "--protected-mode", "no", *self.extra]
        self.proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and self.proc.poll() is None:
            try:
                with self.client() as probe:  # closed now, not whenever the collector gets to it
                    if probe.ping():
                        return
            except redis.exceptions.ConnectionError:
                time.sleep(0.02)
        self.stop()
        raise RuntimeError(f"redis-server did not start on port {self.port}")

    def kill(self) -> None:
        """SIGKILL: the server vanishes mid-run, connections reset."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def restart(self) -> None:
        self.kill()
        self.start()

    def pause(self) -> None:
        """SIGSTOP: the server stays connected but answers nothing (a slow Redis)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGCONT)  # a paused server cannot handle SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
