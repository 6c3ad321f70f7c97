"""CacheBlend on the real model (SmolLM2-135M-Instruct): a document's stored KV moved to a new
position is the KV of that document prefilled there, and a blended answer is the same in-process,
through the sidecar (`POST /v1/blend`) and from `kvstore generate --chunk-file`."""
from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch

from kvstore import KVStore, StoreConfig
from kvstore.decode import generate
from kvstore.decode.attention import AttentionContext
from kvstore.decode.cli import register
from kvstore.api.server.in_process import InProcessSidecar
from kvstore.rerotate import rerotate_into

RATIO = 0.15


@pytest.fixture(scope="module")
def model(smollm2_model):
    return smollm2_model


@pytest.fixture(scope="module")
def parts(model):
    """A short retrieval prompt: system prompt, two documents, a question, each tokenized alone."""
    from pydoc_data.topics import topics

    tok = model.tokenizer
    turn = tok.hf.apply_chat_template([{"role": "system", "content": "Answer from the documents."},
                                       {"role": "user", "content": "\x00"}], tokenize=False,
                                      add_generation_prompt=True)
    opening, closing = turn.split("\x00")
    docs = [tok.encode(topics[name].split("\n\n")[2][:300] + "\n\n") for name in ("assert", "pass")]
    return tok.encode(opening), docs, tok.encode(f"Question: What does the assert statement do?{closing}")


def kv_at(model, tokens: list[int], start: int) -> torch.Tensor:
    """The KV of `tokens` prefilled alone at positions start.. : (L, 2, n, H, D)."""
    n = len(tokens)
    cache = model.new_cache(n)
    table = cache.new_table()
    cache.reserve(table, n)
    slots = cache.slots(table, 0, n)
    model(torch.tensor(tokens), torch.arange(start, start + n), cache,
          AttentionContext(write_slots=slots, read_slots=slots, causal=True), logits="none")
    table.num_tokens = n
    return cache.gather(table, 0, n)


def test_a_moved_document_is_the_document_prefilled_at_its_new_position(model, parts):
    doc = parts[1][0]
    standalone = kv_at(model, doc, 0)
    for position in (137, 3000):
        moved = torch.empty_like(standalone)
        rerotate_into(moved, standalone, model.spec, position)
        there = kv_at(model, doc, position)
        # Attention sees only relative positions, so K and V at every layer are the same up to
        # float32 rounding of the rotation angles; K itself moved by a whole rotation.
        assert (moved - there).abs().max() <= 2e-3 * there.abs().max()
        assert (standalone[:, 0] - there[:, 0]).abs().max() > 0.1 * there[:, 0].abs().max()


def test_blend_through_the_sidecar_and_the_cli_gives_the_in_process_answer(model, parts, tmp_path: Path,
                                                                           capsys: pytest.CaptureFixture):
    from kvstore.api.client import KVStoreClient

    prefix, chunks, question = parts
    config = StoreConfig(data_dir=None, cpu_bytes=256 << 20, disk_bytes=0)
    with KVStore(config) as store:
        generate(model, question, 1, backend=store, prefix=prefix, chunks=chunks[::-1], blend_ratio=RATIO)
        here = generate(model, question, 4, backend=store, prefix=prefix, chunks=chunks, blend_ratio=RATIO,
                        stop_token_ids=(), return_logits=True)
        stored_kv = store.blend(model.name, chunks, start_pos=len(prefix)).kv
        stored = {tuple(c): store.blend(model.name, [c], start_pos=0).kv for c in chunks}
    assert here.chunk_hits == [True, True] and here.recomputed_tokens > 0
    with InProcessSidecar(config) as url:
        with KVStoreClient(url) as client:
            client.register_model(model.name, model.spec)  # the chunks as the store holds them, not computed again
            for chunk in chunks:
                client.store_chunk(model.name, chunk, stored[tuple(chunk)])
            there = generate(model, question, 4, backend=client, prefix=prefix, chunks=chunks, blend_ratio=RATIO,
                             stop_token_ids=(), return_logits=True)
            assert torch.equal(torch.as_tensor(client.blend(model.name, chunks, start_pos=len(prefix)).kv),
                               stored_kv)
        assert there.chunk_hits == [True, True] and there.backend_error is None
        assert there.tokens == here.tokens and (there.logits - here.logits).abs().max() <= 1e-4
        files = []
        for i, chunk in enumerate(chunks):
            (tmp_path / f"doc{i}.txt").write_text(",".join(map(str, chunk)))
            files += ["--chunk-file", str(tmp_path / f"doc{i}.txt")]
        parser = argparse.ArgumentParser(prog="kvstore")
        register(parser.add_subparsers(dest="command", required=True))
        args = parser.parse_args(["generate", "--model", "smollm2", "--server", url, *files,
                                  "--prefix-tokens", ",".join(map(str, prefix)),
                                  "--prompt-tokens", ",".join(map(str, question)),
                                  "--blend-ratio", str(RATIO), "--max-new-tokens", "4"])
        assert args.func(args) == 0
    out = capsys.readouterr()
    assert "chunks hit 2/2" in out.err
    cli_tokens = [int(t) for t in out.out.strip().split(",")]
    assert cli_tokens == here.tokens[:len(cli_tokens)] and cli_tokens
