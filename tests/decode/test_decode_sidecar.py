"""Prefix reuse through a real `kvstore serve` subprocess and `KVStoreClient`, across a restart."""
from __future__ import annotations

import re
import signal
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest
import torch

from kvstore.decode import LlamaModel, generate, tiny_model

client_module = pytest.importorskip("kvstore.api.client")

STEPS = 12


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return tiny_model(init_std=0.05, page_size=8)


class Sidecar:
    """`kvstore serve` on a free loopback port; stopped with SIGTERM like a deployment would."""

    def __init__(self, data_dir: Path):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvstore.cli", "serve", "--host", "127.0.0.1", "--port", "0",
             "--data-dir", str(data_dir), "--cpu-bytes", "16MiB", "--disk-bytes", "64MiB"],
            stdout=subprocess.PIPE, stderr=(data_dir.parent / "sidecar.log").open("a"), text=True)
        seen = []
        for line in self.proc.stdout:  # the startup line names the bound port
            seen.append(line)
            found = re.search(r"http://[\d.]+:\d+", line)
            if found:
                self.url = found.group(0)
                return
        self.proc.kill()
        log = (data_dir.parent / "sidecar.log").read_text()[-2000:]
        pytest.fail(f"kvstore serve did not start: {''.join(seen[-5:])!r}\n{log}")

    def stop(self) -> None:
        self.proc.send_signal(signal.SIGTERM)
        assert self.proc.wait(timeout=30) == 0


@pytest.fixture
def data_dir(tmp_path: Path) -> Iterator[Path]:
    yield tmp_path / "kv"


def test_reuse_through_sidecar_and_after_its_restart(model: LlamaModel, data_dir: Path) -> None:
    first = torch.randint(0, 512, (60,), generator=torch.Generator().manual_seed(3)).tolist()
    second = first[:45] + torch.randint(0, 512, (10,), generator=torch.Generator().manual_seed(4)).tolist()
    baseline = generate(model, second, STEPS, return_logits=True)

    sidecar = Sidecar(data_dir)
    try:
        with client_module.KVStoreClient(sidecar.url) as client:
            generate(model, first, STEPS, backend=client)
            hit = generate(model, second, STEPS, backend=client, return_logits=True)
    finally:
        sidecar.stop()
    assert hit.reused_tokens == 45 and hit.tiers == {"cpu": 45} and hit.backend_error is None
    assert hit.tokens == baseline.tokens
    torch.testing.assert_close(hit.logits, baseline.logits, atol=1e-5, rtol=0)

    sidecar = Sidecar(data_dir)  # only LMDB survived: the hit now comes from the disk tier
    try:
        with client_module.KVStoreClient(sidecar.url) as client:
            again = generate(model, second, STEPS, backend=client, return_logits=True)
    finally:
        sidecar.stop()
    assert again.reused_tokens == len(second) - 1 and again.tiers.get("disk", 0) > 0
    assert again.tokens == baseline.tokens
    torch.testing.assert_close(again.logits, baseline.logits, atol=1e-5, rtol=0)


def test_unreachable_sidecar_is_a_full_prefill_with_a_warning(model: LlamaModel) -> None:
    from kvstore.decode import BackendWarning

    prompt = list(range(30))
    with client_module.KVStoreClient("http://127.0.0.1:9", timeout_s=1.0) as client:  # discard port: refused
        with pytest.warns(BackendWarning):
            result = generate(model, prompt, 4, backend=client)
    assert result.reused_tokens == 0 and result.tokens == generate(model, prompt, 4).tokens
