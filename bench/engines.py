"""The processes a bench starts and talks to, each started one way for every bench: `kvstore serve`,
`kvstore proxy`, a redis-server, vLLM's OpenAI server (as a module: the CPU build's `vllm` script
fails), and vLLM's `LLM` in a process of its own per job (vLLM keeps global state).
"""
from __future__ import annotations

import argparse
import contextlib
import ctypes
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

REPO = Path(__file__).resolve().parents[1]
BLOCK = 32  # vLLM's CPU attention backend takes block sizes that are multiples of 32
REAL_MODEL = "smollm2"
RANDOM_MODEL = dict(vocab_size=32000, hidden_size=512, intermediate_size=1408, num_hidden_layers=4,
                    num_attention_heads=8, num_key_value_heads=2, head_dim=64)
START_TIMEOUT_S = 60.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def child_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository appended to PYTHONPATH (a child imports
    bench/), after whatever PYTHONPATH names: an older kvstore there must stay the one measured."""
    path = os.pathsep.join(p for p in (os.environ.get("PYTHONPATH", ""), str(REPO)) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def run_on_site(script: str, args: list[str], site: str) -> Any:
    """`script ARGS --json FILE` with PYTHONPATH=`site` (an importable copy of other code), from
    a temporary folder (so that `-c` and the script's folder put nothing else first): its JSON."""
    with tempfile.TemporaryDirectory(prefix="kvstore-bench-site-") as tmp:
        out = Path(tmp) / "out.json"
        subprocess.run([sys.executable, str(Path(script).resolve()), *args, "--json", str(out)], check=True,
                       env={**os.environ, "PYTHONPATH": site}, cwd=tmp, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


# -- kvstore serve -------------------------------------------------------------------------------

class SidecarFailed(RuntimeError):
    """The sidecar did not print its startup line (it exited or hung); carries its stderr."""


class Sidecar:
    """One `kvstore serve` process on a port it picks; `args` are extra serve flags. `launch`
    replaces `python -m kvstore.cli` (e.g. a `-c` script that prints kvstore's path first: the
    lines before the startup line are kept in `preamble`). A context manager: killed on exit."""

    def __init__(self, data_dir: Path | str, args: list[str] | tuple[str, ...] = (), *,
                 env: dict[str, str] | None = None, launch: list[str] | None = None, cwd: Path | str = REPO):
        self.data_dir, self.args, self.cwd = str(data_dir), list(args), cwd
        self.env = child_env(**(env or {}))
        self.launch = launch or [sys.executable, "-m", "kvstore.cli"]
        self.proc: subprocess.Popen[str] | None = None
        self.url = ""
        self.preamble: list[str] = []
        self.stderr_lines: list[str] = []

    def start(self) -> "Sidecar":
        self.stderr_lines, self.preamble = [], []
        Path(self.data_dir).mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen([*self.launch, "serve", "--data-dir", self.data_dir, "--port", "0", *self.args],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=self.env,
                                     cwd=self.cwd)
        threading.Thread(target=self._drain_stderr, args=(self.proc,), daemon=True).start()
        deadline = time.monotonic() + START_TIMEOUT_S
        line = _readline(self.proc, START_TIMEOUT_S)
        while line and "serving on http://" not in line and time.monotonic() < deadline:
            self.preamble.append(line.strip())
            line = _readline(self.proc, deadline - time.monotonic())
        if "serving on http://" not in line:
            self.kill()
            raise SidecarFailed(f"kvstore serve did not start ({line!r}): {self.stderr[-2000:]}")
        self.url = line.split("serving on ", 1)[1].split()[0]
        return self

    def __enter__(self) -> "Sidecar":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.kill()

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


def serve_args(cpu_bytes: str | int, disk_bytes: str | int = 0) -> list[str]:
    """The flags of a bench's sidecar: its CPU tier, a disk tier or none, warnings only."""
    return ["--cpu-bytes", str(cpu_bytes), "--disk-bytes", str(disk_bytes), "--log-level", "warning"]


def _readline(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The next stdout line, or "" if none comes within `timeout_s` (the reader thread is left
    to die with the pipe)."""
    box: list[str] = []
    reader = threading.Thread(target=lambda: box.append(proc.stdout.readline()), daemon=True)  # type: ignore[union-attr]
    reader.start()
    reader.join(max(timeout_s, 0.0))
    return box[0] if box else ""


# -- redis-server --------------------------------------------------------------------------------

class RedisServer:
    """A redis-server of our own on a free loopback port, persisting nothing; `start()` raises
    RuntimeError where redis-server is not installed (`make system-deps`) or does not answer."""

    def __init__(self, directory: Path | str):
        self.directory, self.port = str(directory), free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> "RedisServer":
        import redis

        binary = shutil.which("redis-server")
        if binary is None:
            raise RuntimeError("redis-server is not installed (make system-deps)")
        self.proc = subprocess.Popen([binary, "--port", str(self.port), "--bind", "127.0.0.1", "--dir",
                                      self.directory, "--save", "", "--appendonly", "no", "--protected-mode", "no"],
                                     stdout=subprocess.DEVNULL)
        for _ in range(200):
            try:
                redis.Redis(port=self.port).ping()
                return self
            except redis.exceptions.ConnectionError:
                time.sleep(0.025)
        self.stop()
        raise RuntimeError("redis-server did not answer")

    def stop(self) -> None:
        if self.proc is not None:
            self.proc.terminate()
            self.proc.wait(10)


# -- vLLM's OpenAI server ------------------------------------------------------------------------

class EngineServer:
    """`role` None: no connector (vLLM with its own prefix cache alone). `tp` > 1: that many
    tensor-parallel ranks, each a process of its own sharing the machine's cores. `one_process`
    (tp 1 only): the engine core and its worker run in the API server's process, as `vllm serve`
    does with VLLM_ENABLE_V1_MULTIPROCESSING=0 and the "uni" executor: it starts sooner, since
    vLLM is imported by one process, not three (the tests' engines)."""

    def __init__(self, model: Path, role: str | None, store_url: str | None, log_path: Path,
                 kv_cache_bytes: int = 256 << 20, max_model_len: int = 2048, tp: int = 1, one_process: bool = False):
        if one_process and tp > 1:
            raise ValueError(f"one_process: needs tp 1, got tp {tp} (tensor-parallel ranks are processes)")
        self.model, self.role, self.store_url, self.log_path = model, role, store_url, log_path
        self.tp, self.one_process = tp, one_process
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
        if self.one_process:
            command += ["--distributed-executor-backend", "uni"]
            env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
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


@contextlib.contextmanager
def disaggregated(model: Path, store_url: str, work: Path, max_model_len: int, producer_tp: int = 1,
                  consumer_tp: int = 1, ready_timeout_s: float = 600) -> Iterator[str]:
    """A kv_producer and a kv_consumer engine on `store_url` behind `kvstore proxy`, ready: the
    proxy's url; all three killed on exit."""
    prefill = EngineServer(model, "kv_producer", store_url, work / f"prefill-tp{producer_tp}.log",
                           max_model_len=max_model_len, tp=producer_tp).start()
    decode = EngineServer(model, "kv_consumer", store_url, work / f"decode-tp{consumer_tp}.log",
                          max_model_len=max_model_len, tp=consumer_tp).start()
    port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "proxy", "--prefill", prefill.url, "--decode",
                              decode.url, "--port", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        prefill.wait_ready(ready_timeout_s)
        decode.wait_ready(ready_timeout_s)
        yield f"http://127.0.0.1:{port}"
    finally:
        proxy.kill()
        prefill.kill()
        decode.kill()


def _terminate_with_parent() -> None:
    if sys.platform.startswith("linux"):
        PR_SET_PDEATHSIG = 1
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)


# -- vLLM's LLM, one job per process -------------------------------------------------------------

def checkpoint(random_model: bool, directory: Path, dtype: str = "float32") -> Path:
    """The real model (`kvstore model pull smollm2`), or a random-weight Llama written to
    `directory` (RANDOM_MODEL: no download)."""
    if not random_model:
        from kvstore.decode.model_pull import pull

        return pull(REAL_MODEL)
    import torch
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(**RANDOM_MODEL, max_position_embeddings=16384, rms_norm_eps=1e-6,
                                      rope_theta=500000.0, initializer_range=0.02, dtype=dtype)
    transformers.LlamaForCausalLM(config).to(getattr(torch, dtype)).save_pretrained(directory)
    return directory


def model_facts(directory: Path) -> dict[str, Any]:
    """What the engines and the sizes depend on, from the checkpoint's config."""
    config = json.loads((directory / "config.json").read_text())
    heads = config["num_attention_heads"]
    head_dim = config.get("head_dim") or config["hidden_size"] // heads
    return dict(layers=config["num_hidden_layers"], hidden=config["hidden_size"], heads=heads,
                kv_heads=config.get("num_key_value_heads") or heads, head_dim=head_dim, vocab=config["vocab_size"],
                context=config["max_position_embeddings"], has_tokenizer=(directory / "tokenizer.json").exists())


def kv_bytes_per_token(facts: dict[str, Any], dtype: str) -> int:
    return facts["layers"] * 2 * facts["kv_heads"] * facts["head_dim"] * {"float32": 4}.get(dtype, 2)


def make_engine(job: dict[str, Any], **engine: Any) -> Any:
    """vLLM's `LLM` for a job: its model, context, KV cache size and tensor-parallel degree
    (`job["tp"]`, default 1), and the connector with `job["extra"]` as its
    kv_connector_extra_config (None: no connector), from `job["connector_module"]` (default
    kvstore.integrations.vllm)."""
    from vllm import LLM
    from vllm.config import KVTransferConfig

    kwargs: dict[str, Any] = dict(skip_tokenizer_init=True, block_size=BLOCK, enforce_eager=True,
                                  max_model_len=job["max_model_len"], kv_cache_memory_bytes=job["kv_cache_bytes"],
                                  **engine)
    if job.get("tp", 1) > 1:
        kwargs.update(tensor_parallel_size=job["tp"], distributed_executor_backend="mp")
    if job["extra"] is not None:
        kwargs["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KVStoreConnector", kv_role="kv_both",
            kv_connector_module_path=job.get("connector_module", "kvstore.integrations.vllm"),
            kv_connector_extra_config=job["extra"])
    return LLM(job["model"], **kwargs)


def greedy(llm: Any, prompts: list[list[int]], max_tokens: int, salts: Sequence[str | None] | None = None) -> list[Any]:
    """vLLM's greedy answers to token prompts (each under its salt, vLLM's cache_salt, where
    `salts` gives one), each `max_tokens` long (no stop at EOS), no detokenizing, no progress bar."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False, ignore_eos=True)
    salts = salts or [None] * len(prompts)
    return llm.generate([TokensPrompt(prompt_token_ids=p, **({"cache_salt": s} if s else {}))
                         for p, s in zip(prompts, salts)], params, use_tqdm=False)


def parse_or_serve_engine(parser: argparse.ArgumentParser, argv: list[str] | None,
                          engine_main: Callable[[dict[str, Any]], dict[str, Any]]) -> argparse.Namespace | None:
    """The run's arguments (with `--json`), or None after serving `--engine-job`: the process
    `run_engine` starts, which prints its engine's results on an `ENGINE ` line."""
    parser.add_argument("--json", type=Path, help="write the results here")
    parser.add_argument("--engine-job", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.engine_job:
        print("ENGINE " + json.dumps(engine_main(json.loads(args.engine_job))), flush=True)
        return None
    return args


def run_engine(job: dict[str, Any], script: str, **env: str) -> dict[str, Any]:
    """`script --engine-job JOB` in a fresh process (one engine, scheduler and worker in it; its
    tensor-parallel ranks, if any, in processes of their own that import bench/), `env` added to
    its environment: the object its `ENGINE ` line prints."""
    env = child_env(VLLM_ENABLE_V1_MULTIPROCESSING="0", **env)
    done = subprocess.run([sys.executable, script, "--engine-job", json.dumps(job)], capture_output=True, text=True,
                          env=env, timeout=7200)
    lines = [line for line in done.stdout.splitlines() if line.startswith("ENGINE ")]
    if done.returncode != 0 or not lines:
        raise RuntimeError(f"engine {job.get('plan', '')} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1][len("ENGINE "):])
