"""CacheBlend in the decode loop: r = 1 is a full prefill, r = 0 is the stored chunks' KV laid end
to end, chunks stored by one request are reused by another at other positions (in-process and
through the sidecar), and what cannot be exact falls back to a full prefill. The selection rule
and its controls recompute the same number of tokens, each picking what it says."""
from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import pytest
import torch

from kvstore.decode import BackendWarning, generate, tiny_model
from kvstore.decode.attention import AttentionContext
from kvstore.decode.blend import ChunkReuse, blend_prefill
from kvstore.decode.blend_selection import TokenSelection, deviation_score
from kvstore.decode.cli import register
from kvstore.decode.recompute import recompute_sizes
from kvstore.api.server.in_process import InProcessSidecar
from kvstore.rerotate import rerotate_into
from kvstore import KVStore, StoreConfig

ATOL = 1e-4  # float32


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.fixture
def store():
    with KVStore(StoreConfig(data_dir=None, cpu_bytes=64 << 20, disk_bytes=0)) as s:
        yield s


def ids(seed: int, n: int) -> list[int]:
    return torch.randint(0, 512, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def full_logits(model, prefix, chunks, question, max_new_tokens: int = 3) -> torch.Tensor:
    prompt = prefix + [t for c in chunks for t in c] + question
    return generate(model, prompt, max_new_tokens, return_logits=True).logits  # (N, V)


def test_ratio_one_is_a_full_prefill_on_miss_and_on_hit(model, store):
    prefix, chunks, question = ids(0, 5), [ids(1, 20), ids(2, 37), ids(3, 9)], ids(4, 4)
    want = full_logits(model, prefix, chunks, question)
    for hits in ([False] * 3, [True] * 3):
        got = generate(model, question, 3, backend=store, prefix=prefix, chunks=chunks, blend_ratio=1.0,
                       return_logits=True)
        assert got.chunk_hits == hits and got.recomputed_tokens == 66
        assert (got.logits - want).abs().max() <= ATOL


def test_short_attention_segments_change_nothing(model, store, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr("kvstore.decode.recompute.SEGMENT_TOKENS", 5)
    prefix, chunks, question = ids(60, 3), [ids(61, 23), ids(62, 14)], ids(63, 2)
    got = generate(model, question, 2, backend=store, prefix=prefix, chunks=chunks, blend_ratio=1.0, return_logits=True)
    assert (got.logits - full_logits(model, prefix, chunks, question, 2)).abs().max() <= ATOL


def test_ratio_zero_is_the_stored_chunks_concatenated(model, store):
    prefix, chunks, question = ids(5, 7), [ids(6, 16), ids(7, 11)], ids(8, 3)
    generate(model, question, 1, backend=store, prefix=prefix, chunks=chunks, blend_ratio=0.0)  # stores the chunks
    cache = model.new_cache(64)
    table = cache.new_table()
    cache.reserve(table, 7 + 27 + 3)
    reuse = ChunkReuse(model, store)
    outcome = blend_prefill(model, prefix, chunks, question, cache, table, reuse, ratio=0.0)
    assert outcome.chunk_hits == [True, True] and outcome.recomputed_tokens == 0
    stored = store.blend(model.name, chunks, start_pos=7).kv  # (L, 2, 27, H, D)
    assert torch.equal(cache.gather(table, 7, 34), stored)
    # ... and differs from a full prefill: the chunks never saw each other or the prefix.
    assert (outcome.logits - full_logits(model, prefix, chunks, question, 1)[0]).abs().max() > 1e-3


def test_a_stored_chunk_is_reused_at_another_position_after_another_prefix(model, store):
    shared = ids(10, 24)
    first = generate(model, ids(11, 4), 2, backend=store, prefix=ids(12, 3), chunks=[ids(13, 10), shared])
    assert first.chunk_hits == [False, False]
    prefix, chunks, question = ids(14, 19), [shared, ids(15, 8)], ids(16, 5)
    second = generate(model, question, 3, backend=store, prefix=prefix, chunks=chunks, blend_ratio=1.0,
                      return_logits=True)
    assert second.chunk_hits == [True, False] and second.reused_tokens >= 24
    assert (second.logits - full_logits(model, prefix, chunks, question)).abs().max() <= ATOL


def test_through_the_sidecar_client(model):
    from kvstore.api.client import KVStoreClient

    prefix, chunks, question = ids(20, 6), [ids(21, 12), ids(22, 17)], ids(23, 3)
    want = full_logits(model, prefix, chunks, question)
    config = StoreConfig(data_dir=None, cpu_bytes=32 << 20, disk_bytes=0)
    with InProcessSidecar(config) as url, KVStoreClient(url) as client:
        generate(model, question, 1, backend=client, prefix=ids(24, 2), chunks=chunks[::-1], blend_ratio=0.0)
        got = generate(model, question, 3, backend=client, prefix=prefix, chunks=chunks, blend_ratio=1.0,
                       return_logits=True)
    assert got.chunk_hits == [True, True] and got.backend_error is None
    assert (got.logits - want).abs().max() <= ATOL


def test_rope_that_cannot_be_rerotated_falls_back_to_a_full_prefill(store):
    model = tiny_model()
    prefix, chunks, question = ids(30, 3), [ids(31, 9), ids(32, 5)], ids(33, 2)
    want = full_logits(model, prefix, chunks, question)
    model.spec = dataclasses.replace(model.spec, rope_scaling=(("factor", 2.0), ("rope_type", "dynamic")))
    with pytest.warns(BackendWarning, match="dynamic"):
        got = generate(model, question, 3, backend=store, prefix=prefix, chunks=chunks, blend_ratio=0.0,
                       return_logits=True)
    assert "dynamic" in got.backend_error and (got.logits - want).abs().max() <= ATOL


def test_a_failing_backend_degrades_to_computing_the_chunks(model, store):
    class Broken:
        def __getattr__(self, name):
            return getattr(store, name)

        def blend(self, *args, **kwargs):
            raise ConnectionError("down")

    prefix, chunks, question = ids(40, 4), [ids(41, 8), ids(42, 8)], ids(43, 2)
    with pytest.warns(BackendWarning, match="blend"):
        got = generate(model, question, 2, backend=Broken(), prefix=prefix, chunks=chunks, blend_ratio=1.0,
                       return_logits=True)
    assert got.chunk_hits == [False, False] and "down" in got.backend_error
    assert (got.logits - full_logits(model, prefix, chunks, question, 2)).abs().max() <= ATOL


def test_recompute_schedule_filters_gradually():
    assert recompute_sizes(100, 0.15, 6) == [100, 60, 30, 23, 15, 15]  # the decode loop's: 4r, 2r, 1.5r, r
    assert recompute_sizes(100, 1.0, 3) == [100, 100, 100]
    assert recompute_sizes(100, 0.0, 3) == [0, 0, 0]
    with pytest.raises(ValueError, match="blend_ratio"):
        recompute_sizes(10, 1.5, 2)
    later = TokenSelection(select_layer=2, narrowing=(4.0, 2.0, 1.0))  # every token through layers 0-1
    assert recompute_sizes(100, 0.1, 6, later) == [100, 100, 40, 20, 10, 10]
    per_layer = TokenSelection(narrowing=(2.0, 2.0, 0.5))  # more early, less late
    assert recompute_sizes(100, 0.1, 6, per_layer) == [100, 20, 20, 5, 5, 5]
    assert later.last_narrowing == 4 and TokenSelection().last_narrowing == 4


def test_selection_schedules_and_shares_are_checked():
    for bad, field in (({"narrowing": (1.0, 2.0)}, "narrowing"), ({"narrowing": ()}, "narrowing"),
                       ({"select_layer": 0}, "select_layer"), ({"query_share": 1.5}, "query_share"),
                       ({"first_share": 0.6, "query_share": 0.6}, "first_share \\+ query_share")):
        with pytest.raises(ValueError, match=field):
            TokenSelection(**bad)


def test_bad_blend_arguments_are_value_errors(model):
    with pytest.raises(ValueError, match="blend_ratio"):
        generate(model, [1], 1, chunks=[[2]], blend_ratio=2)
    with pytest.raises(ValueError, match="chunks"):
        generate(model, [1], 1, chunks=[])
    with pytest.raises(ValueError, match="prompt_tokens"):
        generate(model, [1], 1, chunks=[[]])


def test_cli_chunk_files_store_then_hit(tmp_path: Path, capsys: pytest.CaptureFixture):
    files = []
    for i, chunk in enumerate([ids(50, 12), ids(51, 7)]):
        files += ["--chunk-file", str(tmp_path / f"c{i}.txt")]
        (tmp_path / f"c{i}.txt").write_text(" ".join(map(str, chunk)))
    argv = ["generate", "--model", "tiny", "--prompt-tokens", "1,2,3", "--prefix-tokens", "7,8", *files,
            "--max-new-tokens", "2", "--data-dir", str(tmp_path / "kv"), "--blend-ratio", "1.0"]
    parser = argparse.ArgumentParser(prog="kvstore")
    register(parser.add_subparsers(dest="command", required=True))
    for hits in ("chunks hit 0/2", "chunks hit 2/2"):
        args = parser.parse_args(argv)
        assert args.func(args) == 0
        out = capsys.readouterr()
        assert hits in out.err and len(out.out.strip().split(",")) == 2


def blended(model, store, prefix, chunks, question, ratio: float, selection: TokenSelection):
    cache = model.new_cache(256)
    table = cache.new_table()
    cache.reserve(table, len(prefix) + sum(map(len, chunks)) + len(question))
    return blend_prefill(model, prefix, chunks, question, cache, table, ChunkReuse(model, store), ratio=ratio,
                         selection=selection)


def test_controls_recompute_as_many_tokens_as_the_rule_and_all_of_them_at_one(model, store):
    prefix, chunks, question = ids(70, 5), [ids(71, 30), ids(72, 21), ids(73, 13)], ids(74, 3)
    want = full_logits(model, prefix, chunks, question, 1)[0]
    outcomes = {rule: blended(model, store, prefix, chunks, question, 0.15, TokenSelection(rule))
                for rule in ("deviation", "random", "first")}
    # recomputed_tokens: those through the last layer that runs attention, the one before the last
    assert {o.recomputed_tokens for o in outcomes.values()} == {recompute_sizes(64, 0.15, 4)[-2]}
    assert len({tuple(o.logits.tolist()) for o in outcomes.values()}) == 3  # different tokens, different KV
    for rule in ("random", "first"):
        full = blended(model, store, prefix, chunks, question, 1.0, TokenSelection(rule))
        assert full.recomputed_tokens == 64 and (full.logits - want).abs().max() <= ATOL


def test_first_rule_takes_the_same_opening_fraction_of_every_chunk():
    position = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3])  # a chunk of 8 tokens, then one of 4
    length = torch.tensor([8] * 8 + [4] * 4)
    picked = TokenSelection("first").pick(6, layer=1, chunk_position=position, chunk_length=length)
    assert picked.tolist() == [0, 1, 2, 3, 8, 9]


def test_deviation_rule_gives_half_its_budget_to_every_chunks_opening():
    position = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3])  # a chunk of 8 tokens, then one of 4
    length = torch.tensor([8] * 8 + [4] * 4)
    k = torch.zeros(12, 1, 2)
    fresh = k.clone()
    fresh[[6, 7, 11], 0, 0] = torch.tensor([3.0, 2.0, 1.0])  # the tokens that deviate, late in their chunks
    pick = lambda share, keep: TokenSelection("deviation", first_share=share, score="pooled").pick(  # noqa: E731
        keep, layer=1, fresh=(fresh, fresh), cached=(k, k), chunk_position=position, chunk_length=length).tolist()
    assert pick(0.5, 4) == [0, 6, 7, 8] and pick(0.0, 3) == [6, 7, 11] and pick(1.0, 2) == [0, 8]
    with pytest.raises(ValueError, match="first_share"):
        TokenSelection(first_share=1.5)


def test_query_share_goes_to_the_tokens_the_question_reads_and_impact_weighs_deviation_by_it():
    position = torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3])  # a chunk of 8 tokens, then one of 4
    length = torch.tensor([8] * 8 + [4] * 4)
    k = torch.zeros(12, 1, 2)
    fresh = k.clone()
    fresh[[6, 7, 11], 0, 0] = torch.tensor([3.0, 2.0, 1.0])  # deviation: 6, then 7, then 11
    attention = torch.zeros(12)
    attention[[4, 10, 11]] = torch.tensor([0.5, 0.3, 0.9])  # the question reads 11, then 4, then 10
    pick = lambda keep, **kw: TokenSelection(**kw).pick(  # noqa: E731
        keep, layer=1, fresh=(fresh, fresh), cached=(k, k), chunk_position=position, chunk_length=length,
        attention=attention).tolist()
    assert pick(4, first_share=0.5, query_share=0.25, score="pooled") == [0, 6, 8, 11]  # openings, question, deviation
    assert pick(2, first_share=0.0, query_share=1.0) == [4, 11]
    assert pick(1, first_share=0.0, score="impact") == [11]  # 1.0 * 0.9 beats 3.0 * 0 and 2.0 * 0
    assert TokenSelection(query_share=0.2).needs_attention and TokenSelection(score="impact").needs_attention
    assert TokenSelection().needs_attention  # the decode loop's rule: impact
    assert not TokenSelection(score="pooled").needs_attention and not TokenSelection("first").needs_attention


def test_question_attention_rule_is_a_full_prefill_at_one_and_recomputes_as_much_below(model, store):
    prefix, chunks, question = ids(90, 5), [ids(91, 30), ids(92, 21), ids(93, 13)], ids(94, 4)
    want = full_logits(model, prefix, chunks, question, 1)[0]
    reading = TokenSelection(first_share=0.25, query_share=0.5)
    full = blended(model, store, prefix, chunks, question, 1.0, reading)
    assert full.recomputed_tokens == 64 and (full.logits - want).abs().max() <= ATOL
    got = {s: blended(model, store, prefix, chunks, question, 0.15, s) for s in (reading, TokenSelection("first"))}
    assert {o.recomputed_tokens for o in got.values()} == {recompute_sizes(64, 0.15, 4)[-2]}
    assert got[reading].logits.isfinite().all()


def test_random_rule_is_seeded():
    position, length = torch.arange(50), torch.full((50,), 50)
    pick = lambda seed, layer: TokenSelection("random", seed=seed).pick(  # noqa: E731
        10, layer=layer, chunk_position=position, chunk_length=length).tolist()
    assert pick(0, 1) == pick(0, 1) and pick(0, 1) != pick(1, 1) and pick(0, 1) != pick(0, 2)
    assert pick(0, 1) == sorted(set(pick(0, 1)))


def test_per_head_deviation_keeps_one_loud_head_from_deciding():
    gen = torch.Generator().manual_seed(0)
    cached = torch.zeros(8, 2, 4)  # (C, H, D): 8 candidates, 2 KV heads
    fresh = torch.zeros(8, 2, 4)
    fresh[:, 0] = torch.rand(8, 4, generator=gen) * 10  # head 0: loud everywhere, nothing stands out
    fresh[:, 1] = torch.rand(8, 4, generator=gen) * 0.01
    fresh[5, 0] = 0.0
    fresh[5, 1] = 0.3  # head 1: quiet, except token 5, far off the others there
    pooled = deviation_score((fresh, fresh), (cached, cached))
    per_head = deviation_score((fresh, fresh), (cached, cached), per_head=True)
    assert int(per_head.argmax()) == 5 and int(pooled.argmax()) != 5
    picked = TokenSelection("deviation", score="per_head").pick(
        1, layer=1, fresh=(fresh, fresh), cached=(cached, cached), chunk_position=torch.arange(8),
        chunk_length=torch.full((8,), 8))
    assert picked.tolist() == [5]


def test_selection_rules_are_checked():
    with pytest.raises(ValueError, match="selection rule"):
        TokenSelection("best")
    with pytest.raises(ValueError, match="selection score"):
        TokenSelection(score="cosine")


def test_rerotated_chunk_is_the_chunk_prefilled_at_its_new_position(model):
    chunk, position = ids(80, 40), 300
    kv = {}
    for start in (0, position):  # the chunk alone, at positions 0.. and at position..
        cache = model.new_cache(position + 40)
        table = cache.new_table()
        cache.reserve(table, position + 40)
        model(torch.tensor(chunk), torch.arange(start, start + 40), cache,
              AttentionContext(write_slots=cache.slots(table, position, position + 40),
                               read_slots=cache.slots(table, position, position + 40), causal=True))
        table.num_tokens = position + 40
        kv[start] = cache.gather(table, position, position + 40)  # (L, 2, 40, H, D)
    moved = torch.empty_like(kv[0])
    rerotate_into(moved, kv[0], model.spec, position)
    assert (moved - kv[position]).abs().max() <= ATOL
    assert (kv[0][:, 0] - kv[position][:, 0]).abs().max() > 0.1  # K does depend on where it was computed
