"""The vLLM connector's audit, without an engine (kvstore/integrations/vllm_audit.py): which hits
withhold a block, which step audits it, and what a failed audit reports. The real model in vLLM:
`python bench/chaos.py --only audit` (bench/reliability/vllm_audit.py)."""
from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from kvstore.integrations.connector_config import ConnectorConfig
from kvstore.integrations.vllm_audit import SchedulerAudits, WorkerAudits

B = 32


def step(req_id: str, computed: int, scheduled: int) -> SimpleNamespace:
    return SimpleNamespace(scheduled_new_reqs=[SimpleNamespace(req_id=req_id, num_computed_tokens=computed)],
                           num_scheduled_tokens={req_id: scheduled})


def test_an_audited_hit_withholds_its_last_block_and_the_step_that_computes_it_audits_it():
    audits = SchedulerAudits(1.0, B)
    assert audits.withhold("r", 0, 4 * B, load_async=False) == 3 * B
    prompt = list(range(200))
    audits.allocated("r", None, prompt, block_ids=[7, 8, 9, 10, 11, 12, 13], load_start=0, load_end=3 * B)
    [spec] = audits.take(step("r", 3 * B, 200 - 3 * B))
    assert (spec.start, spec.block_id, spec.loaded_block_ids, spec.tokens) == (3 * B, 10, [7, 8, 9], prompt[:4 * B])
    assert len(audits) == 0


def test_what_is_not_audited():
    audits = SchedulerAudits(1.0, B)
    assert audits.withhold("one-block", 0, B, load_async=False) == B  # nothing would be loaded
    assert audits.withhold("local", 2 * B, 3 * B, load_async=False) == 3 * B  # vLLM's own hit ends a block before
    assert audits.withhold("async", 0, 4 * B, load_async=True) == 4 * B  # its block is computed in a later step
    assert SchedulerAudits(0.0, B).withhold("off", 0, 4 * B, load_async=False) == 4 * B
    sampled = SchedulerAudits(0.5, B, random.Random(0))
    withheld = sum(sampled.withhold(str(i), 0, 4 * B, load_async=False) == 3 * B for i in range(400))
    assert 150 < withheld < 250
    # A step too short to compute the withheld block does not audit it.
    short = SchedulerAudits(1.0, B)
    short.withhold("r", 0, 4 * B, load_async=False)
    short.allocated("r", None, list(range(200)), [1, 2, 3, 4, 5], 0, 3 * B)
    assert short.take(step("r", 3 * B, B - 1)) == []
    short.forget("r")
    assert len(short) == 0


class Layout:  # the canonical (num_blocks, 2, B, H, D) blocks
    def gather(self, layer: torch.Tensor, block_ids: torch.Tensor, out=None) -> torch.Tensor:
        return layer[block_ids[0]]


class Link:
    def __init__(self, stored: torch.Tensor):
        self.stored, self.reports = stored, []

    def audit_source(self, tokens, start, salt):
        return "cpu", self.stored

    def report_audit(self, tokens, salt, *, passed, tier, layer):
        self.reports.append((passed, tier, layer))


@pytest.mark.parametrize("wrong_layer", [None, 2])
def test_the_worker_compares_each_layer_and_a_failure_becomes_load_errors(wrong_layer):
    L, H, D = 4, 2, 8
    caches = [torch.randn(6, 2, B, H, D, generator=torch.Generator().manual_seed(i)) for i in range(L)]
    stored = torch.stack([c[3] for c in caches])  # (L, 2, B, H, D): the block as the store holds it
    if wrong_layer is not None:
        stored[wrong_layer, 1] = stored[wrong_layer, 1].roll(1, dims=-2)  # V heads in the wrong order
    audits = SchedulerAudits(1.0, B)
    audits.withhold("r", 0, 4 * B, load_async=False)
    audits.allocated("r", "salt", list(range(150)), [0, 1, 2, 3, 4], 0, 3 * B)
    specs = audits.take(step("r", 3 * B, 150 - 3 * B))
    worker, link = WorkerAudits(L, torch.float32), Link(stored)
    worker.start(link, specs, torch.device("cpu"))
    for i, cache in enumerate(caches):
        worker.on_layer(Layout(), cache, i)
    failed, spoiled = worker.finish(link)
    if wrong_layer is None:
        assert (failed, spoiled, link.reports) == (set(), set(), [(True, "cpu", None)])
    else:
        assert failed == {0, 1, 2} and spoiled == {"r"} and link.reports == [(False, "cpu", wrong_layer)]
    assert worker.finish(link) == (set(), set())  # judged once


def test_audit_rate_in_the_connector_config():
    assert ConnectorConfig.from_extra_config({"cpu_bytes": "64MiB"}).audit_rate == 0.0
    assert ConnectorConfig.from_extra_config({"url": "http://127.0.0.1:1", "audit_rate": 0.01}).audit_rate == 0.01
    with pytest.raises(ValueError, match=r"kv_connector_extra_config.audit_rate: must be a number in \[0, 1\]"):
        ConnectorConfig.from_extra_config({"cpu_bytes": "64MiB", "audit_rate": 2})


def test_an_audit_of_a_few_tokens_withholds_only_them_and_compares_only_them():
    W = 8
    audits = SchedulerAudits(1.0, B, withheld_tokens=W)
    assert audits.withhold("r", 0, 4 * B, load_async=False) == 4 * B - W  # vLLM computes the last W
    prompt = list(range(200))
    audits.allocated("r", None, prompt, block_ids=[7, 8, 9, 10, 11, 12, 13], load_start=0, load_end=4 * B - W)
    assert audits.take(step("r", 4 * B - W, W - 1)) == []  # a step that stops short of the block's end
    audits.withhold("r", 0, 4 * B, load_async=False)
    audits.allocated("r", None, prompt, block_ids=[7, 8, 9, 10, 11, 12, 13], load_start=0, load_end=4 * B - W)
    [spec] = audits.take(step("r", 4 * B - W, 200 - (4 * B - W)))
    # The block's earlier tokens are loaded (a load error on a failure), its last W computed.
    assert (spec.start, spec.first, spec.block_id, spec.loaded_block_ids, spec.tokens) == \
        (3 * B, 4 * B - W, 10, [7, 8, 9, 10], prompt[:4 * B])

    L, H, D = 3, 2, 8
    caches = [torch.randn(12, 2, B, H, D, generator=torch.Generator().manual_seed(i)) for i in range(L)]
    right = torch.stack([c[10] for c in caches])  # (L, 2, B, H, D)
    for wrong_tokens, passes in ((slice(0, B - W), True), (slice(B - 1, B), False)):
        stored = right.clone()
        stored[1, 0, wrong_tokens] += 1.0  # layer 1's K off in these tokens
        worker, link = WorkerAudits(L, torch.float32), Link(stored)
        worker.start(link, [spec], torch.device("cpu"))
        for i, cache in enumerate(caches):
            worker.on_layer(Layout(), cache, i)
        failed, _ = worker.finish(link)
        # Loaded tokens are vLLM's copy of the store's (not what it computed): only the withheld
        # ones are compared, so a difference in the loaded ones is not this comparison's to see.
        assert link.reports == [(passes, "cpu", None if passes else 1)]
        assert failed == (set() if passes else {7, 8, 9, 10})


def test_audit_tokens_in_the_connector_config():
    assert ConnectorConfig.from_extra_config({"cpu_bytes": "64MiB"}).audit_tokens == 1
    assert ConnectorConfig.from_extra_config({"cpu_bytes": "64MiB", "audit_tokens": 32}).audit_tokens == 32
    for bad in (0, -1, 1.5, True, "8"):
        with pytest.raises(ValueError, match=r"kv_connector_extra_config.audit_tokens: must be an integer in \[1"):
            ConnectorConfig.from_extra_config({"cpu_bytes": "64MiB", "audit_tokens": bad})


@pytest.mark.parametrize("computed_from", [3 * B - 8, 3 * B])
def test_a_load_ending_inside_a_block_leaves_the_tokens_vllm_computes(computed_from):
    from kvstore.integrations.paged_layout import ContentSplitLayout
    from kvstore.integrations.vllm_scheduler import LoadSpec
    from kvstore.integrations.vllm_worker import _Load

    H, D = 2, 8
    layout = ContentSplitLayout("test", B, H, D)
    layer = torch.randn(6, H, B, 2 * D)  # vLLM's cache, with this step's own KV already written
    before = layout.gather(layer, torch.tensor([0, 2, 5]))  # (2, 3B, H, D)
    stored = torch.randn(1, 2, 3 * B, H, D)  # (L, 2, T, H, D): the store's three blocks
    spec = LoadSpec("r", None, list(range(3 * B)), 0, [0, 2, 5], computed_from=computed_from)
    _Load(spec, torch.tensor([0, 2, 5]), 1, kv=stored).scatter(layout, layer, 0)
    after = layout.gather(layer, torch.tensor([0, 2, 5]))
    torch.testing.assert_close(after[:, :computed_from], stored[0, :, :computed_from], rtol=0, atol=0)
    torch.testing.assert_close(after[:, computed_from:], before[:, computed_from:], rtol=0, atol=0)
