"""kvstore between vLLM and the decode loop on a real model: SmolLM2-135M-Instruct, float32.

Chat prompts (a section of Python's own documentation, then a question) are rendered with the
model's chat template and answered greedily, 8 tokens at most; every check compares the answer's
text and token ids with a full prefill's by the same engine.

The module runs one story, once (the `story` fixture), with one vLLM engine alive at a time in
this process (VLLM_ENABLE_V1_MULTIPROCESSING=0):

    engine 1   in-process store on a data directory, empty: answers question 2 about document
               B, a full prefill, and stores its blocks -> shut down: the store closes, its
               pages are on disk
    decode     the decode loop, a client of a `kvstore serve` sidecar: prefills question 1
               about B (stored)
    engine 2   a fresh engine on the sidecar: B's question 2 (the document's KV the decode loop
               stored), then a question about document C (nothing to hit: computed and stored)
    decode     C's question again, from vLLM's pages, and as a full prefill without the store
    engine 3   engine 1 restarted on the same data directory: B's question 2, from the disk tier

Both sides name the store's model by the checkpoint directory (`smollm2`), so no setting is
needed for one to hit the other's pages; a hit also shows both hold the same spec (vLLM left at
dtype "auto" would serve this float32 checkpoint in bfloat16 on a CPU, and share nothing).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (without CUDA, make install brings its CPU build)")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM builds an engine

import pydoc_data.topics  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from integrations.sidecar_process import Sidecar  # noqa: E402
from kvstore import KVStoreClient  # noqa: E402
from kvstore.decode import generate  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.heavy]

BLOCK = 32  # vLLM's block size; the store's pages are 16 tokens, the decode loop's
MAX_TOKENS = 8  # enough for an answer to diverge, few enough for `make test`
# Float32 KV of this model is 30 layers x 2 x 3 heads x 64 x 4 bytes = 46,080 bytes a token:
# 64 blocks hold two 1k-token requests.
KV_TOKEN_BYTES = 30 * 2 * 3 * 64 * 4
ENGINE = dict(dtype="float32", block_size=BLOCK, enforce_eager=True, max_model_len=1024,
              kv_cache_memory_bytes=64 * BLOCK * KV_TOKEN_BYTES)


def ask(document: str, question: str) -> list[dict[str, str]]:
    return [{"role": "user", "content": f"{pydoc_data.topics.topics[document]}\n\n{question}"}]


B1, B2 = ask("return", "What does a return statement do?"), ask("return", "What happens to return in a generator?")
C1 = ask("truth", "Which values are false?")


@dataclass
class Answer:
    prompt_ids: list[int]
    tokens: list[int]
    text: str
    cached: int  # vLLM: num_cached_tokens; the decode loop: reused_tokens


def whole_blocks(n: int) -> int:
    return n // BLOCK * BLOCK


def common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


class Engine:
    """A vLLM engine with the kvstore connector, in this process; closing it closes its store."""

    def __init__(self, directory: Path, extra: dict[str, Any]):
        transfer = KVTransferConfig(kv_connector="KVStoreConnector", kv_role="kv_both",
                                    kv_connector_module_path="kvstore.integrations.vllm",
                                    kv_connector_extra_config=extra)
        self.llm = LLM(str(directory), kv_transfer_config=transfer, **ENGINE)

    def ask(self, messages: list[dict[str, str]]) -> Answer:
        """The greedy answer, the conversation rendered by vLLM's own tokenizer and chat template."""
        ids = list(self.llm.get_tokenizer().apply_chat_template(messages, add_generation_prompt=True, tokenize=True,
                                                                return_dict=False))
        params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.0)
        out = self.llm.generate([TokensPrompt(prompt_token_ids=ids)], params, use_tqdm=False)[0]
        return Answer(ids, list(out.outputs[0].token_ids), out.outputs[0].text, out.num_cached_tokens)

    def close(self) -> None:
        self.llm.llm_engine.engine_core.shutdown()
        del self.llm  # the next engine's weights and KV cache replace these


def decode_answer(model, messages, backend=None, store: bool = True, max_tokens: int = MAX_TOKENS) -> Answer:
    result = generate(model, messages, max_tokens, backend, store=store)
    assert result.backend_error is None
    return Answer(result.prompt_ids, result.tokens, result.text, result.reused_tokens)


@pytest.fixture(scope="module")
def story(tmp_path_factory, smollm2: Path, smollm2_model) -> dict[str, Answer]:
    directory, model = smollm2, smollm2_model  # the decode loop's side, loaded once per process
    root = tmp_path_factory.mktemp("real-model")
    in_process = {"data_dir": str(root / "store"), "cpu_bytes": "64MiB", "disk_bytes": "128MiB"}
    sidecar = Sidecar(root / "sidecar", cpu_bytes="64MiB", disk_bytes="0")
    answers: dict[str, Answer] = {}
    engine = Engine(directory, in_process)
    try:
        answers["vllm B2 full"] = engine.ask(B2)
    finally:
        engine.close()
    sidecar.start()
    try:
        with KVStoreClient(sidecar.url) as client:
            # Only its prompt's pages matter here: one token is enough.
            answers["decode B1"] = decode_answer(model, B1, client, max_tokens=1)
            engine = Engine(directory, {"url": sidecar.url})
            try:
                answers["vllm B2 from decode"] = engine.ask(B2)
                answers["vllm C1 full"] = engine.ask(C1)
            finally:
                engine.close()
            answers["decode C1 from vllm"] = decode_answer(model, C1, client, store=False)
        answers["decode C1 full"] = decode_answer(model, C1)
    finally:
        sidecar.kill()
    engine = Engine(directory, in_process)
    try:
        answers["vllm B2 restarted"] = engine.ask(B2)
    finally:
        engine.close()
    return answers


def test_both_render_a_conversation_to_the_same_ids(story):
    assert story["vllm C1 full"].prompt_ids == story["decode C1 full"].prompt_ids


def test_full_prefills_answer_in_words(story):
    for name in ("vllm B2 full", "vllm C1 full", "decode C1 full"):
        answer = story[name]
        assert answer.cached == 0, name
        assert len(answer.text.split()) >= 4, (name, answer.text)


def test_a_restarted_engine_answers_from_the_disk_tier_with_the_same_text(story):
    full, restarted = story["vllm B2 full"], story["vllm B2 restarted"]
    # every whole block but the one holding the last token, stored by the engine before its restart
    assert restarted.cached == whole_blocks(len(full.prompt_ids) - 1) > 0
    assert restarted.text == full.text
    assert restarted.tokens == full.tokens


def test_a_fresh_engine_answers_from_the_decode_loops_pages_through_the_sidecar(story):
    full, warm = story["vllm B2 full"], story["vllm B2 from decode"]
    # the document's blocks, stored by the decode loop answering question 1
    assert warm.cached == whole_blocks(common_prefix(story["decode B1"].prompt_ids, warm.prompt_ids)) > 0
    assert warm.text == full.text
    assert warm.tokens == full.tokens


def test_the_decode_loop_answers_from_vllms_pages_with_the_same_text(story):
    vllm, warm, full = story["vllm C1 full"], story["decode C1 from vllm"], story["decode C1 full"]
    # vLLM stored the prompt's whole blocks; the decode loop reuses them, in 16-token pages, up
    # to the last prompt token (which it computes: the first token needs its logits)
    assert warm.cached == min(whole_blocks(len(vllm.prompt_ids)), (len(full.prompt_ids) - 1) // 16 * 16) > 0
    assert warm.text == full.text
    assert warm.tokens == full.tokens


def test_vllm_and_the_decode_loop_give_the_same_answer(story):
    # Two float32 implementations of the same model, greedy: the same tokens.
    assert story["vllm C1 full"].tokens == story["decode C1 full"].tokens
    assert story["vllm C1 full"].text == story["decode C1 full"].text
