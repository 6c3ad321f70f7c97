"""Prefill/decode disaggregation on the real model: a prefill engine, a decode engine, one sidecar
between them, and `kvstore proxy` in front, all processes of their own as a user runs them.

The reference is the decode engine's own full prefill of each prompt: a request with a cache
salt nothing was stored under, so neither vLLM's prefix cache nor the store holds any of it.
Through the proxy, each answer must be that text and those tokens; the decode engine must have
loaded all but the last block of the prompt; and once the prefill engine is killed, the proxy
must go on answering the same, the decode engine computing the prompts itself.
"""
from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
import uuid

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (without CUDA, make install brings its CPU build)")

import pydoc_data.topics  # noqa: E402

from bench.engines import BLOCK, EngineServer  # noqa: E402
from integrations.sidecar_process import Sidecar, free_port  # noqa: E402
from kvstore.decode.model_pull import pull  # noqa: E402

pytestmark = [pytest.mark.timeout(900), pytest.mark.heavy]

MAX_TOKENS = 8
TOPICS = ["for", "while", "with", "return"]


def chat(index: int) -> list[dict[str, str]]:
    topic = TOPICS[index]
    return [{"role": "system", "content": pydoc_data.topics.topics[topic].strip()[:2500]},
            {"role": "user", "content": f"In one sentence: what is this section about ({topic})?"}]


def post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=300) as answer:
        return json.loads(answer.read())


def ask(base_url: str, model: str, messages, **extra) -> tuple[str, int, int]:
    """(text, prompt tokens, tokens the engine did not compute) of a greedy answer."""
    body = post(base_url + "/v1/chat/completions", {"model": model, "messages": messages, "max_tokens": MAX_TOKENS,
                                                    "temperature": 0, **extra})
    usage = body["usage"]
    cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0
    return body["choices"][0]["message"]["content"], usage["prompt_tokens"], cached


@pytest.fixture(scope="module")
def deployment(tmp_path_factory):
    root = tmp_path_factory.mktemp("disagg")
    model = pull("smollm2")
    sidecar = Sidecar(root / "store", cpu_bytes="512MiB", disk_bytes="0")
    sidecar.start()
    # Each engine in one process: the scheduler-worker split across processes is test_vllm_tensor_parallel.py's.
    prefill = EngineServer(model, "kv_producer", sidecar.url, root / "prefill.log", one_process=True).start()
    decode = EngineServer(model, "kv_consumer", sidecar.url, root / "decode.log", one_process=True).start()
    proxy_port = free_port()
    proxy = subprocess.Popen([sys.executable, "-m", "kvstore.cli", "proxy", "--prefill", prefill.url,
                              "--decode", decode.url, "--port", str(proxy_port)],
                             stdout=subprocess.DEVNULL, stderr=open(root / "proxy.log", "wb"))
    try:
        prefill.wait_ready()
        decode.wait_ready()
        yield {"model": str(model), "prefill": prefill, "decode": decode, "proxy": f"http://127.0.0.1:{proxy_port}",
               "sidecar": sidecar}
    finally:
        proxy.kill()
        prefill.kill()
        decode.kill()
        sidecar.kill()


@pytest.fixture(scope="module")
def answers(deployment):
    """Per prompt: the reference, then through the proxy; the prefill engine dies after half."""
    d = deployment
    half = len(TOPICS) // 2
    found = []
    for i in range(len(TOPICS)):
        if i == half:
            d["prefill"].kill()
            time.sleep(0.5)
        reference = ask(d["decode"].url, d["model"], chat(i), cache_salt=f"reference-{uuid.uuid4()}")
        served = ask(d["proxy"], d["model"], chat(i))
        found.append((i < half, reference, served))
    return found


def test_the_proxys_answers_are_one_engines_answers(answers):
    for _, (ref_text, ref_prompt, ref_cached), (text, prompt, _) in answers:
        assert ref_cached == 0  # the reference computed everything
        assert prompt == ref_prompt and text == ref_text and text.strip()


def test_the_decode_engine_loads_all_but_the_last_block_from_the_prefill(answers):
    with_prefill = [(prompt, cached) for prefilled, _, (_, prompt, cached) in answers if prefilled]
    assert len(with_prefill) >= 2 and all(prompt >= 3 * BLOCK for prompt, _ in with_prefill)
    for prompt, cached in with_prefill:
        assert cached >= prompt - BLOCK, (prompt, cached)


def test_a_dead_prefill_engine_costs_a_recompute_and_the_same_answers(answers, deployment):
    after = [served for prefilled, _, served in answers if not prefilled]
    assert len(after) >= 2
    assert all(cached == 0 for _, _, cached in after)  # nobody stored these prompts: computed by the decode engine
    with urllib.request.urlopen(deployment["proxy"] + "/healthz", timeout=10) as answer:
        health = json.loads(answer.read())
    assert health["prefilled"] == len(TOPICS) // 2 and health["prefill_skipped"] == len(after)
