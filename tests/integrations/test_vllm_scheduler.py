"""The connector's scheduler side against a real in-process store, driven with the fields vLLM's
scheduler hands it: hits are whole blocks and never the whole prompt, each prompt block is
stored once as it is computed, and nothing outlives a request."""
from __future__ import annotations

import types

import pytest
import torch

from kvstore import ModelSpec
from kvstore.integrations.connector_config import ConnectorConfig
from kvstore.integrations.store_link import StoreLink
from kvstore.integrations.vllm_scheduler import SchedulerSide

BLOCK = 32
SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=16)


@pytest.fixture
def link(tmp_path):
    config = ConnectorConfig.from_extra_config({"data_dir": str(tmp_path), "cpu_bytes": "16MiB", "disk_bytes": 0})
    link = StoreLink(config, "m", SPEC)
    yield link
    link.close()


def request(req_id: str, prompt: list[int], salt: str | None = None, **extra):
    return types.SimpleNamespace(request_id=req_id, prompt_token_ids=prompt, cache_salt=salt, mm_features=[],
                                 lora_request=None, prompt_embeds=None, **extra)


def step(new=(), cached=(), resumed=()):
    """A SchedulerOutput: new = [(req_id, block_ids, num_computed, scheduled)], cached likewise."""
    return types.SimpleNamespace(
        scheduled_new_reqs=[types.SimpleNamespace(req_id=r, block_ids=(b,), num_computed_tokens=c)
                            for r, b, c, _ in new],
        scheduled_cached_reqs=types.SimpleNamespace(
            req_ids=[r for r, *_ in cached], resumed_req_ids=set(resumed),
            new_block_ids=[(b,) if b is not None else None for _, b, _, _ in cached],
            num_computed_tokens=[c for _, _, c, _ in cached]),
        num_scheduled_tokens={r: s for r, _, _, s in [*new, *cached]})


def store_prefix(link: StoreLink, tokens: list[int], salt=None) -> None:
    kv = torch.randn(SPEC.kv_shape(len(tokens))).to(torch.bfloat16)
    assert link.store(tokens, kv, 0, salt) == len(tokens)


def test_a_hit_is_whole_blocks_and_never_the_whole_prompt(link):
    prompt = list(range(1, 129))  # 4 blocks
    store_prefix(link, prompt)
    side = SchedulerSide(link, BLOCK)
    req = request("a", prompt)
    side.on_new_request(req)
    assert side.matched_tokens(req, 0) == 96  # the last block holds the last token: computed
    assert side.matched_tokens(req, 0) == 96  # asking again changes nothing
    assert side.matched_tokens(req, 64) == 32  # beyond vLLM's own hit
    assert side.matched_tokens(req, 96) == 0
    short = request("b", prompt[:100] + [999] * 20)  # the store holds 100 of its tokens: 3 whole blocks
    side.on_new_request(short)
    assert side.matched_tokens(short, 0) == 96


def test_loads_target_the_allocated_blocks_past_the_local_hit(link):
    prompt = list(range(1, 161))
    store_prefix(link, prompt)
    side = SchedulerSide(link, BLOCK)
    req = request("a", prompt)
    side.on_new_request(req)
    assert side.matched_tokens(req, 32) == 96
    side.after_alloc(req, [10, 11, 12, 13, 14], 96)
    meta = side.build_meta(step(new=[("a", [10, 11, 12, 13, 14], 128, 32)]))
    (load,) = meta.loads
    assert (load.start, load.block_ids, load.tokens) == (32, [11, 12, 13], prompt[:128])
    (save,) = meta.saves  # the block the step computes is stored; the loaded ones are not sent again
    assert (save.start, len(save.tokens), save.block_ids) == (128, 160, [10, 11, 12, 13, 14])
    assert side.build_meta(step(cached=[("a", None, 160, 1)])).loads == []


def test_chunked_prefill_stores_each_chunk_once_and_never_the_partial_block(link):
    prompt = list(range(1, 201))  # 6 whole blocks + 8 tokens
    side = SchedulerSide(link, BLOCK)
    req = request("a", prompt)
    side.on_new_request(req)
    assert side.matched_tokens(req, 0) == 0
    side.after_alloc(req, [1, 2, 3], 0)
    first = side.build_meta(step(new=[("a", [1, 2, 3], 0, 80)]))  # 80 tokens: 2 whole blocks done
    assert [(s.start, len(s.tokens)) for s in first.saves] == [(0, 64)]
    second = side.build_meta(step(cached=[("a", [4, 5, 6, 7], 80, 120)]))  # done: 200 tokens
    assert [(s.start, len(s.tokens), s.block_ids) for s in second.saves] == [(64, 192, [1, 2, 3, 4, 5, 6])]
    decode = side.build_meta(step(cached=[("a", None, 200, 1)]))
    assert decode.saves == []


def test_a_producer_stores_and_never_loads_and_says_what_it_stored(link):
    prompt = list(range(1, 201))  # 6 whole blocks + 8 tokens
    store_prefix(link, prompt[:96])  # a hit a kv_both engine would load
    producer = SchedulerSide(link, BLOCK, role="kv_producer")
    req = request("p", prompt)
    producer.on_new_request(req)
    assert producer.matched_tokens(req, 0) == 0
    producer.after_alloc(req, list(range(7)), 0)
    meta = producer.build_meta(step(new=[("p", list(range(7)), 0, 200)]))
    assert meta.loads == [] and [(s.start, len(s.tokens)) for s in meta.saves] == [(0, 192)]
    assert producer.request_finished(req) == 192  # every whole prompt block
    assert producer.num_tracked == 0


def test_a_consumer_loads_and_never_stores_prompt_blocks(link):
    prompt = list(range(1, 201))
    store_prefix(link, prompt[:192])  # what a producer stored
    consumer = SchedulerSide(link, BLOCK, role="kv_consumer")
    req = request("c", prompt)
    consumer.on_new_request(req)
    assert consumer.matched_tokens(req, 0) == 192  # all but the block holding the last token
    consumer.after_alloc(req, list(range(7)), 192)
    meta = consumer.build_meta(step(new=[("c", list(range(7)), 192, 8)]))
    assert [(load.start, len(load.tokens)) for load in meta.loads] == [(0, 192)] and meta.saves == []
    fresh = request("f", list(range(500, 600)))  # nothing stored: computed, and still not stored
    consumer.on_new_request(fresh)
    assert consumer.matched_tokens(fresh, 0) == 0
    assert consumer.build_meta(step(new=[("f", [8, 9, 10, 11], 0, 100)])).saves == []


def test_an_unknown_role_is_refused_by_name(link):
    with pytest.raises(ValueError, match="kv_role: must be one of kv_producer, kv_consumer, kv_both, got 'kv_prefill'"):
        SchedulerSide(link, BLOCK, role="kv_prefill")


def test_finished_aborted_and_preempted_requests_leave_nothing_behind(link):
    prompt = list(range(1, 129))
    store_prefix(link, prompt)
    side = SchedulerSide(link, BLOCK)
    done, aborted, preempted = request("done", prompt), request("aborted", prompt), request("pre", prompt)
    for r in (done, aborted, preempted):
        side.on_new_request(r)
        side.matched_tokens(r, 0)
    side.after_alloc(done, [1, 2, 3, 4], 96)
    side.build_meta(step(new=[("done", [1, 2, 3, 4], 96, 32)]))
    side.request_finished(done)
    side.request_finished(aborted)  # aborted while waiting: a lookup answer was kept, now gone
    # Preempted and resumed: asked again, loads into its new blocks, then finishes.
    side.after_alloc(preempted, [5, 6, 7, 8], 96)
    side.build_meta(step(new=[("pre", [5, 6, 7, 8], 96, 32)]))
    assert side.matched_tokens(preempted, 0) == 96
    side.after_alloc(preempted, [20, 21, 22, 23], 96)
    meta = side.build_meta(step(cached=[("pre", [20, 21, 22, 23], 96, 33)], resumed=["pre"]))
    assert [load.block_ids for load in meta.loads] == [[20, 21, 22]]
    side.request_finished(preempted)
    assert side.num_tracked == 0


def test_requests_the_store_cannot_key_by_tokens_alone_never_use_it(link):
    prompt = list(range(1, 129))
    store_prefix(link, prompt)
    side = SchedulerSide(link, BLOCK)
    lora = request("lora", prompt)
    lora.lora_request = object()
    side.on_new_request(lora)
    assert side.matched_tokens(lora, 0) == 0
    assert side.build_meta(step(new=[("lora", [1, 2, 3, 4], 0, 128)])).saves == []


def test_a_salt_hits_only_what_the_same_salt_stored_in_process(link):
    prompt = list(range(1, 129))
    store_prefix(link, prompt, salt="alice")
    side = SchedulerSide(link, BLOCK)
    for req_id, salt, hit in (("a", "alice", 96), ("b", "bob", 0), ("c", None, 0), ("d", "", 0)):
        r = request(req_id, prompt, salt)
        side.on_new_request(r)
        assert side.matched_tokens(r, 0) == hit, salt


def test_a_salt_the_store_would_refuse_is_computed_and_leaves_the_store_working(link, caplog):
    prompt = list(range(1, 129))
    store_prefix(link, prompt)
    side = SchedulerSide(link, BLOCK)
    long_salt = request("x", prompt, "x" * 5000)
    side.on_new_request(long_salt)
    assert side.matched_tokens(long_salt, 0) == 0 and side.num_tracked == 0
    assert any("cache_salt" in rec.getMessage() for rec in caplog.records)
    plain = request("y", prompt)  # the store was not marked down by it
    side.on_new_request(plain)
    assert side.matched_tokens(plain, 0) == 96


def test_an_unreachable_sidecar_is_a_miss_and_is_left_alone_after(caplog):
    config = ConnectorConfig.from_extra_config({"url": "http://127.0.0.1:9", "timeout_s": 1})
    link = StoreLink(config, "m", SPEC)
    side = SchedulerSide(link, BLOCK)
    for i in range(3):
        r = request(str(i), list(range(1, 129)))
        side.on_new_request(r)
        assert side.matched_tokens(r, 0) == 0
    assert len([rec for rec in caplog.records if "kvstore lookup failed" in rec.getMessage()]) == 1
    link.close()


def test_a_sidecar_that_never_answers_costs_at_most_timeout_s():
    import socket
    import time

    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(8)  # accepts connections, never answers
        config = ConnectorConfig.from_extra_config({"url": f"http://127.0.0.1:{server.getsockname()[1]}",
                                                    "timeout_s": 0.5, "shared_memory_bytes": 0})
        link = StoreLink(config, "m", SPEC)
        side = SchedulerSide(link, BLOCK)
        started = time.monotonic()
        for i in range(3):
            r = request(str(i), list(range(1, 129)))
            side.on_new_request(r)
            assert side.matched_tokens(r, 0) == 0
        assert time.monotonic() - started < 2.0  # one timeout, then the store is left alone
        link.close()


def test_an_async_load_is_reported_to_the_worker_and_a_failed_one_is_never_offered_again(link):
    prompt = list(range(1, 129))
    store_prefix(link, prompt)
    side = SchedulerSide(link, BLOCK, load_async=True)
    r = request("a", prompt)
    side.on_new_request(r)
    assert side.matched_tokens(r, 0) == 96
    side.after_alloc(r, [10, 11, 12, 13], 96)
    (load,) = side.build_meta(step()).loads  # the request is not in the step's batch: it waits
    assert load.load_async and load.block_ids == [10, 11, 12]
    side.load_errors({12})  # the worker could not fill its last block
    assert side.matched_tokens(r, 0) == 0  # rescheduled by vLLM, it is computed: no second load
    other = request("b", prompt)
    side.on_new_request(other)
    assert side.matched_tokens(other, 0) == 96  # other requests still load
