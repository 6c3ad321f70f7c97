"""kvstore as vLLM's KV connector, end to end on vLLM's CPU build with a tiny random Llama.

One engine lives in this process for the whole module (VLLM_ENABLE_V1_MULTIPROCESSING=0, so
scheduler and worker share it), talking to a `kvstore serve` sidecar started here with a
disk-only tier and an auth file (three tenants). Its own prefix cache is off, so every hit it
reports (`num_cached_tokens`) came from the store, and a preempted request resumes from the
store. Fresh engines run as new processes (run_vllm_engine.py), vLLM's prefix cache on but
empty, as a restarted server's would be.

"Identical to a run without the connector" is checked against a full prefill of the same prompt
by the same engine under a cache_salt longer than the store takes (MAX_SALT_BYTES): the connector
leaves such a request to vLLM alone, so that is vLLM computing every token itself.
"""
from __future__ import annotations

import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (without CUDA, make install brings its CPU build)")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # before vLLM builds an engine

import lmdb  # noqa: E402
from vllm import LLM, SamplingParams  # noqa: E402
from vllm.config import KVTransferConfig  # noqa: E402
from vllm.distributed.kv_transfer import get_kv_transfer_group  # noqa: E402
from vllm.inputs import TokensPrompt  # noqa: E402

from integrations.decode_kv import decode_kv  # noqa: E402
from integrations.sidecar_process import Sidecar  # noqa: E402
from kvstore import KVStore, KVStoreClient, StoreConfig  # noqa: E402
from kvstore.decode.engine import generate  # noqa: E402
from kvstore.decode.loader import load_checkpoint  # noqa: E402
from kvstore.limits import MAX_SALT_BYTES  # noqa: E402

pytestmark = [pytest.mark.timeout(600), pytest.mark.heavy]

BLOCK = 32
PREFIX = 640  # the prompts' shared prefix: 20 whole blocks
TOKENS = {"tok-default": "default", "tok-alice": "alice", "tok-bob": "bob"}
RUNNER = Path(__file__).with_name("run_vllm_engine.py")
# 48 blocks of 32 tokens: room for one 700-token request and its decode, so three at once preempt.
ENGINE = dict(skip_tokenizer_init=True, block_size=BLOCK, enforce_eager=True, max_model_len=1024, dtype="bfloat16",
              max_num_batched_tokens=256, kv_cache_memory_bytes=48 * 16 * 1024)
# This process's engine: vLLM's own prefix cache off, so hits are the store's.
LOCAL_ENGINE = dict(ENGINE, enable_prefix_caching=False)


def prompt_tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(3, 500) for _ in range(n)]


SHARED = prompt_tokens(0, PREFIX)  # each test's prompts come from seeds no other test uses


@pytest.fixture(scope="module")
def checkpoint(checkpoints) -> Path:
    return checkpoints["gqa"]


@pytest.fixture(scope="module")
def sidecar(tmp_path_factory):
    root = tmp_path_factory.mktemp("sidecar")
    (root / "auth.json").write_text(json.dumps(TOKENS))
    side = Sidecar(root / "data", root / "auth.json", default_token="tok-default")
    side.start()
    yield side
    side.kill()


def extra_config(sidecar: Sidecar) -> dict:
    return {"url": sidecar.url, "token": "tok-default", "tokens": {"alice": "tok-alice", "bob": "tok-bob"},
            "timeout_s": 5, "retry_after_s": 1}


@pytest.fixture(scope="module")
def llm(checkpoint, sidecar):
    transfer = KVTransferConfig(kv_connector="KVStoreConnector", kv_connector_module_path="kvstore.integrations.vllm",
                                kv_role="kv_both", kv_connector_extra_config=extra_config(sidecar))
    engine = LLM(str(checkpoint), kv_transfer_config=transfer, **LOCAL_ENGINE)
    yield engine
    engine.llm_engine.engine_core.shutdown()


@pytest.fixture(scope="module")
def client(sidecar):
    with KVStoreClient(sidecar.url, token="tok-default") as c:
        yield c


@pytest.fixture(scope="module")
def decode_model(checkpoint):
    return load_checkpoint(checkpoint)  # bfloat16, as the checkpoint says; page_size 16


def run(llm: LLM, prompts: list[list[int]], *, salt: str | None = None,
        max_tokens: int = 8) -> list[tuple[list[int], int]]:
    """(greedy tokens, num_cached_tokens) per prompt; all prompts in one generate call."""
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False)
    outs = llm.generate([TokensPrompt(prompt_token_ids=p, **({"cache_salt": salt} if salt else {})) for p in prompts],
                        params, use_tqdm=False)
    return [(list(o.outputs[0].token_ids), o.num_cached_tokens) for o in outs]


UNSERVED_SALT = "unserved-" + "x" * MAX_SALT_BYTES  # too long for the store: never loaded nor stored


def recomputed(llm: LLM, prompt: list[int], max_tokens: int = 8) -> list[int]:
    """The tokens of a full prefill: the store is never asked for an unserved salt."""
    tokens, cached = run(llm, [prompt], salt=UNSERVED_SALT, max_tokens=max_tokens)[0]
    assert cached == 0
    return tokens


def run_fresh_engine(checkpoint: Path, extra: dict, prompts: list[list[int]]) -> list[dict]:
    """Outputs of a new engine process (scheduler and worker in it)."""
    job = {"model": str(checkpoint), "extra": extra, "prompts": prompts, "max_tokens": 8,
           "engine": ENGINE}
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    done = subprocess.run([sys.executable, str(RUNNER), json.dumps(job)], capture_output=True, text=True, timeout=300,
                          env=env)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    assert done.returncode == 0 and lines, done.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])["outputs"]


# -- the shared prefix, from one engine to the next ---------------------------------------------

def test_a_fresh_engine_in_another_process_gets_the_shared_prefix_from_the_sidecar(llm, checkpoint, sidecar, client):
    first = SHARED + prompt_tokens(1, 60)
    tokens, cached = run(llm, [first])[0]
    assert cached == 0  # new to vLLM and to the store
    assert client.lookup("gqa", first).matched_tokens == len(first) // BLOCK * BLOCK  # every whole prompt block stored
    second = SHARED + prompt_tokens(2, 60)
    expected = recomputed(llm, second)
    (fresh,) = run_fresh_engine(checkpoint, extra_config(sidecar), [second])
    assert fresh["cached"] == PREFIX  # the prefix in whole blocks, from what this process computed
    assert fresh["tokens"] == expected


def test_an_in_process_store_serves_a_restarted_engine_from_its_disk_tier(llm, checkpoint, decode_model, tmp_path):
    extra = {"data_dir": str(tmp_path / "data"), "cpu_bytes": "32MiB", "disk_bytes": "64MiB"}
    first, second = SHARED + prompt_tokens(3, 50), SHARED + prompt_tokens(4, 50)
    # What a stopped server leaves: the shared prefix on the disk of its data directory. The
    # decode loop writes it (vLLM's own writes to an in-process store that closes are the real
    # model's story, tests/integrations/test_vllm_real_model.py), which spares an engine start.
    store = KVStore(StoreConfig(data_dir=extra["data_dir"], cpu_bytes=32 << 20, disk_bytes=64 << 20))
    try:
        assert generate(decode_model, first, 1, store).stored_tokens >= PREFIX
    finally:
        store.close()
    expected = recomputed(llm, second)
    # A new process with only the disk tier. (A worker in a process of its own, served the store
    # by the scheduler's process through the connector's loopback sidecar, is
    # test_vllm_tensor_parallel.py's TP=2 engine on a directory the decode loop wrote.)
    (restarted,) = run_fresh_engine(checkpoint, extra, [second])
    assert restarted == {"tokens": expected, "cached": PREFIX}


# -- one KV layout for vLLM and our decode loop ---------------------------------------------------

def test_vllm_pages_hold_the_kv_our_decode_loop_computes(llm, client, decode_model):
    prompt = prompt_tokens(5, 700)
    run(llm, [prompt])
    fetched = client.fetch("gqa", prompt[:672])
    assert fetched.matched_tokens == 672
    ours = decode_kv(decode_model, prompt[:672])
    assert fetched.kv.shape == ours.shape and fetched.kv.dtype == ours.dtype == torch.bfloat16
    # Two bf16 computations of the same math, by different kernels. The first layer's V is one
    # matmul of the same normed inputs: equal to the bit. Its K is rotated by each side's own RoPE
    # tables: within one bf16 step (2^-7 relative) nearly everywhere. The second layer inherits
    # the first's rounding through attention and the MLP: within 2% of the values' scale.
    # A wrong layout (K transposed, heads swapped, blocks out of order) is off by 100%.
    assert torch.equal(fetched.kv[0, 1], ours[0, 1])
    diff = (fetched.kv.float() - ours.float()).abs()
    scale = ours.float().abs()
    assert float((diff[0, 0] <= 2 ** -7 * scale[0, 0] + 1e-3).float().mean()) > 0.97
    for layer in range(2):
        for kind in range(2):
            assert float(diff[layer, kind].max()) <= 0.02 * float(scale[layer, kind].max())
            assert float(diff[layer, kind].mean()) <= 0.02 * float(scale[layer, kind].mean())


def test_the_decode_loop_reuses_vllms_pages(llm, client, decode_model):
    prompt = SHARED + prompt_tokens(6, 40)
    run(llm, [prompt])  # the shared prefix is in the store already; this adds the suffix
    cold = generate(decode_model, prompt, 8, None)
    warm = generate(decode_model, prompt, 8, client, store=False)
    assert warm.reused_tokens == len(prompt) // BLOCK * BLOCK and warm.backend_error is None
    assert warm.tokens == cold.tokens


def test_vllm_reuses_the_decode_loops_pages(llm, client, decode_model):
    prompt = prompt_tokens(7, 700)  # never seen by vLLM
    stored = generate(decode_model, prompt, 4, client)
    assert stored.stored_tokens >= len(prompt)
    expected = recomputed(llm, prompt)
    tokens, cached = run(llm, [prompt])[0]
    assert cached == (len(prompt) - 1) // BLOCK * BLOCK
    assert tokens == expected


# -- tenancy ---------------------------------------------------------------------------------

def test_two_cache_salts_never_share_and_the_same_salt_does(llm, sidecar):
    prompt = prompt_tokens(8, 500)
    expected = recomputed(llm, prompt)
    assert run(llm, [prompt], salt="alice")[0] == (expected, 0)
    assert run(llm, [prompt], salt="bob")[0] == (expected, 0)
    assert run(llm, [prompt])[0] == (expected, 0)  # no salt: the default tenant, which has none of it
    assert run(llm, [prompt], salt="alice")[0] == (expected, 480)
    with KVStoreClient(sidecar.url, token="tok-bob") as bob:
        assert bob.lookup("gqa", prompt, salt="bob").matched_tokens == 480  # bob's own copy: his whole blocks
        assert bob.lookup("gqa", prompt).matched_tokens == 0  # in bob's tenant, under the salt only


# -- chunked prefill and preemption ------------------------------------------------------------

def test_chunked_prefill_stores_every_chunk_and_loads_across_chunks(llm, client):
    prompt = prompt_tokens(9, 900)  # 256 tokens a step: four chunks
    expected = recomputed(llm, prompt)
    run(llm, [prompt])
    assert client.lookup("gqa", prompt).matched_tokens == 896
    tokens, cached = run(llm, [prompt])[0]
    assert (tokens, cached) == (expected, 896)  # 896 loaded at once, though a step computes 256


def test_preempted_requests_store_and_load_correctly(llm):
    prompts = [prompt_tokens(10 + i, 600) for i in range(3)]
    # The same batch under the unserved salt: the same preemptions, recomputed by
    # vLLM. (Not each prompt alone: a batch's bf16 numerics differ from a lone request's.)
    expected = [tokens for tokens, _ in run(llm, prompts, salt=UNSERVED_SALT, max_tokens=200)]
    stats = get_kv_transfer_group().worker.stats
    loaded_before = stats["loaded_tokens"]
    got = run(llm, prompts, max_tokens=200)  # three at once need 75 blocks of 48: some are preempted
    assert [tokens for tokens, _ in got] == expected
    assert stats["loaded_tokens"] > loaded_before  # a resumed request loaded its prompt from the store
    assert get_kv_transfer_group().worker.stats["failed_blocks"] == 0


# -- failures never change the output ------------------------------------------------------------

def settled_records(data_dir: Path) -> int:
    """The sidecar's LMDB records, once its disk writer has stopped adding any (another process
    may open the environment: LMDB locks across processes)."""
    env = lmdb.open(str(data_dir / "pages"), max_dbs=2, readonly=True, lock=True)
    try:
        data, last, deadline = env.open_db(b"data", create=False), -1, time.monotonic() + 30
        while time.monotonic() < deadline:
            with env.begin() as txn:
                count = txn.stat(data)["entries"]
            if count == last:
                return count
            last = count
            time.sleep(0.5)
        return last
    finally:
        env.close()


def test_a_page_corrupted_between_lookup_and_load_is_recomputed(llm, sidecar):
    prompt = prompt_tokens(23, 700)
    expected = recomputed(llm, prompt)
    assert run(llm, [prompt])[0] == (expected, 0)
    assert settled_records(sidecar.data_dir) >= 672 // 16
    # Every record on the sidecar's disk is damaged; its index still lists the pages, so the
    # lookup promises the prefix and the load finds it corrupt.
    pages = str(sidecar.data_dir / "pages")
    with lmdb.open(pages, max_dbs=2, readonly=True, lock=True) as reader:
        map_size = reader.info()["map_size"]  # the sidecar's: a writer must map as much
    env = lmdb.open(pages, max_dbs=2, lock=True, map_size=map_size, sync=False, metasync=False)
    data = env.open_db(b"data", create=False)
    with env.begin() as txn:
        keys = [key for key, _ in txn.cursor(data)]
    for key in keys:  # a transaction each: rewriting them all at once would need the map twice over
        with env.begin(write=True) as txn:
            flipped = bytearray(txn.get(key, db=data))
            flipped[len(flipped) // 2] ^= 0x10
            txn.put(key, bytes(flipped), db=data)
    env.close()
    stats = get_kv_transfer_group().worker.stats
    failed_before = stats["failed_blocks"]
    tokens, _ = run(llm, [prompt])[0]
    assert tokens == expected
    assert stats["failed_blocks"] > failed_before  # promised, not delivered: vLLM recomputed those blocks


def test_a_killed_sidecar_costs_a_recompute_not_an_error(llm, sidecar, client):
    prompt = prompt_tokens(21, 700)
    expected = recomputed(llm, prompt)
    assert run(llm, [prompt])[0] == (expected, 0)
    sidecar.kill()
    started = time.monotonic()
    assert run(llm, [prompt])[0] == (expected, 0)
    assert run(llm, [SHARED + prompt_tokens(22, 30)])[0][1] == 0
    assert time.monotonic() - started < 10  # nothing waited out a timeout per request
    sidecar.start()  # the same disk: the pages are back
    time.sleep(1.2)  # the connector leaves a failed store alone for retry_after_s (1 s here)
    assert run(llm, [prompt])[0] == (expected, 672)
