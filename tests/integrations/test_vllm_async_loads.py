"""Asynchronous loads (`load_async`): a request whose prefix the store holds waits outside the
batch while the connector loads its blocks, and the other requests of the batch go on. On vLLM's
CPU build with a tiny random Llama and an in-process store: a batch that mixes hits and misses
gives every prompt the tokens vLLM computes alone, and a load that fails part-way (or wholly) is
recomputed, the same tokens again.

The reference is each prompt computed by vLLM alone (a cache_salt too long for the store, which
the connector leaves to vLLM). The engine runs in float32 so a prompt's greedy tokens do not
depend on which requests share its batch (they would in bfloat16)."""
from __future__ import annotations

import os
import random

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (without CUDA, make install brings its CPU build)")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM builds an engine

from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from integrations.conftest import save_checkpoint  # noqa: E402
from kvstore.limits import MAX_SALT_BYTES  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.heavy]

BLOCK = 32
UNSERVED_SALT = "unserved-" + "x" * MAX_SALT_BYTES  # too long for the store: vLLM alone


@pytest.fixture(scope="module")
def llm(tmp_path_factory):
    root = tmp_path_factory.mktemp("async-loads")
    checkpoint = save_checkpoint(root / "gqa-f32", seed=3, dtype="float32", num_attention_heads=4,
                                 num_key_value_heads=2)
    extra = {"data_dir": str(root / "store"), "cpu_bytes": "64MiB", "disk_bytes": 0, "load_async": True}
    transfer = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
                                kv_role="kv_both", kv_connector_extra_config=extra)
    engine = LLM(str(checkpoint), kv_transfer_config=transfer, skip_tokenizer_init=True, block_size=BLOCK,
                 enforce_eager=True, max_model_len=1024, dtype="float32", max_num_batched_tokens=512,
                 enable_prefix_caching=False, kv_cache_memory_bytes=96 * 32 * 1024)
    yield engine
    engine.llm_engine.engine_core.shutdown()


def prompt_tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


def run(llm: LLM, prompts: list[list[int]], salt: str | None = None) -> list[tuple[list[int], int]]:
    params = SamplingParams(max_tokens=8, temperature=0.0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p, **({"cache_salt": salt} if salt else {})) for p in prompts],
                        params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in outs]


def alone(llm: LLM, prompt: list[int]) -> list[int]:
    tokens, cached = run(llm, [prompt], UNSERVED_SALT)[0]
    assert cached == 0
    return tokens


def worker():
    return get_kv_transfer_group().worker


def test_a_batch_mixing_hits_and_misses_gives_every_prompt_its_own_tokens(llm):
    shared = prompt_tokens(100, 320)  # 10 blocks
    hits = [shared + prompt_tokens(101 + i, 40) for i in range(2)]
    misses = [prompt_tokens(110 + i, 300) for i in range(2)]
    batch = [hits[0], misses[0], hits[1], misses[1]]
    expected = [alone(llm, p) for p in batch]
    run(llm, [shared + [7]])  # stores the 10 shared blocks
    loaded, in_place = worker().stats["loaded_tokens"], worker().stats["in_place_tokens"]

    got = run(llm, batch)
    assert [tokens for tokens, _ in got] == expected
    assert [cached for _, cached in got] == [320, 0, 320, 0]
    assert worker().stats["loaded_tokens"] - loaded == 640
    assert worker().stats["in_place_tokens"] - in_place == 640  # read from the CPU tier's pages where they lie
    assert not worker()._async_loads  # every load was reported finished


def test_a_load_that_fails_part_way_is_recomputed_to_the_same_tokens(llm):
    prompt = prompt_tokens(120, 400)
    expected = alone(llm, prompt)
    run(llm, [prompt])  # stores its 12 whole blocks
    link = worker().link
    fetch_in_place = link.fetch_in_place

    def short_fetch(tokens, start, salt, into=None):  # the store lost the last 4 blocks between lookup and load
        matched, kv, pinned = fetch_in_place(tokens, start, salt, into)
        keep = max(start, matched - 4 * BLOCK)
        if keep <= start and pinned is not None:
            pinned.release()
        return keep, (kv[:, :, :keep - start] if kv is not None and keep > start else None), pinned

    failed, loaded = worker().stats["failed_blocks"], worker().stats["loaded_tokens"]
    link.fetch_in_place = short_fetch
    try:
        tokens, _ = run(llm, [prompt])[0]
    finally:
        link.fetch_in_place = fetch_in_place
    assert tokens == expected
    # 8 of the 12 blocks loaded; vLLM recomputed the 4 reported as load errors.
    assert worker().stats["loaded_tokens"] - loaded == 8 * BLOCK
    assert worker().stats["failed_blocks"] - failed == 4


def test_a_load_that_raises_is_recomputed_to_the_same_tokens(llm):
    prompt = prompt_tokens(130, 200)
    expected = alone(llm, prompt)
    run(llm, [prompt])
    link = worker().link
    fetch, fetch_in_place = link.fetch, link.fetch_in_place

    def broken(tokens, start, salt, into=None):
        raise RuntimeError("the store's answer was lost")

    link.fetch = link.fetch_in_place = broken
    try:
        assert run(llm, [prompt])[0] == (expected, 0)
    finally:
        link.fetch, link.fetch_in_place = fetch, fetch_in_place
    assert run(llm, [prompt])[0] == (expected, 192)  # the store still serves it afterwards
