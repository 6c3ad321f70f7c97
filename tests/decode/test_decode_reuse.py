"""Prefix reuse through the real KVStore changes nothing the user sees except the cost.

Greedy tokens are identical and logits agree within 1e-5 with and without reuse, for hits served
by the CPU tier, by the disk tier after a restart or after demotion, hits ending inside a page,
fully cached prompts and multi-turn conversations.
"""
from __future__ import annotations

from pathlib import Path

import pytest
import torch

from kvstore.decode import GenerateResult, LlamaModel, generate, tiny_model
from kvstore.config import StoreConfig
from kvstore.store import KVStore

TOL = 1e-5
PAGE = 8
STEPS = 16


@pytest.fixture(scope="module")
def model() -> LlamaModel:
    return tiny_model(init_std=0.05, page_size=PAGE)  # init_std: peaked enough that greedy is not a tie


def tokens(seed: int, n: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


FIRST = tokens(1, 50)  # 6 full pages and a 2-token tail page


def assert_same_output(reused: GenerateResult, baseline: GenerateResult) -> None:
    assert reused.tokens == baseline.tokens
    torch.testing.assert_close(reused.logits, baseline.logits, atol=TOL, rtol=0)


def run(model: LlamaModel, prompt: list[int], store: KVStore | None) -> GenerateResult:
    return generate(model, prompt, STEPS, backend=store, return_logits=True)


def cpu_store() -> KVStore:
    return KVStore(StoreConfig(data_dir=None, cpu_bytes=16 << 20, disk_bytes=0))


@pytest.mark.parametrize("shared", [37, 40, 49], ids=["inside-page", "page-boundary", "inside-tail-page"])
def test_cpu_tier_hit_reuses_every_shared_token(model: LlamaModel, shared: int) -> None:
    prompt = FIRST[:shared] + tokens(2, 20)
    with cpu_store() as store:
        first = run(model, FIRST, store)
        assert first.reused_tokens == 0 and first.stored_tokens == len(FIRST) + STEPS - 1
        hit = run(model, prompt, store)
    assert (hit.reused_tokens, hit.computed_tokens) == (shared, len(prompt) - shared)
    assert hit.tiers == {"cpu": shared}
    assert_same_output(hit, run(model, prompt, None))


def test_fully_cached_prompt_computes_only_its_last_token(model: LlamaModel) -> None:
    with cpu_store() as store:
        first = run(model, FIRST, store)
        again = run(model, FIRST, store)
    assert (again.reused_tokens, again.computed_tokens) == (len(FIRST) - 1, 1)
    assert_same_output(again, first)


def test_multi_turn_reuses_the_previous_answer(model: LlamaModel) -> None:
    with cpu_store() as store:
        turn1 = run(model, FIRST, store)
        prompt2 = FIRST + turn1.tokens + tokens(3, 10)
        turn2 = run(model, prompt2, store)
        prompt3 = prompt2 + turn2.tokens + tokens(4, 5)
        turn3 = run(model, prompt3, store)
    # Everything but the last generated token (never fed back, so it has no KV) is reused.
    assert turn2.reused_tokens == len(FIRST) + STEPS - 1
    assert turn3.reused_tokens == len(prompt2) + STEPS - 1
    assert_same_output(turn2, run(model, prompt2, None))
    assert_same_output(turn3, run(model, prompt3, None))


def test_disk_tier_hit_after_restart(model: LlamaModel, tmp_path: Path) -> None:
    config = StoreConfig(data_dir=str(tmp_path / "kv"), cpu_bytes=4 << 20, disk_bytes=64 << 20)
    with KVStore(config) as store:
        run(model, FIRST, store)
    prompt = FIRST[:45] + tokens(5, 12)
    with KVStore(config) as store:  # a new process would see exactly this: only LMDB survives
        hit = run(model, prompt, store)
    assert hit.reused_tokens == 45 and hit.tiers == {"disk": 45}
    assert_same_output(hit, run(model, prompt, None))


def test_hit_served_by_cpu_and_disk_after_demotion(model: LlamaModel, tmp_path: Path) -> None:
    page_bytes = model.spec.page_bytes
    config = StoreConfig(data_dir=str(tmp_path / "kv"), cpu_bytes=3 * page_bytes, disk_bytes=64 << 20)
    with KVStore(config) as store:
        run(model, FIRST, store)  # 9 pages into a 3-page CPU tier: the rest are demoted to disk
        found = store.lookup(model.name, FIRST)
        assert found.tiers.get("disk", 0) > 0
        prompt = FIRST[:42] + tokens(6, 9)
        hit = run(model, prompt, store)
    assert hit.reused_tokens == 42 and sum(hit.tiers.values()) == 42
    assert_same_output(hit, run(model, prompt, None))
