"""Pages written in parts and read in slices through the sidecar: each tensor-parallel rank a
client, over shared memory and TCP alike, with the errors a rank's bad part gets."""
from __future__ import annotations

import pytest
import torch
from api_helpers import call, random_kv

from kvstore import ModelSpec
from kvstore.api.client import KVStoreClient
from kvstore.errors import InvalidKV, InvalidRequest, PartConflict

SPEC = ModelSpec(num_layers=2, num_kv_heads=3, head_dim=8, dtype="bfloat16", page_size=4)


@pytest.mark.parametrize("shared_memory", [True, False], ids=["shm", "tcp"])
def test_ranks_store_their_heads_and_readers_of_any_degree_fetch(live_server, store, shared_memory):
    shm = None if shared_memory else 0
    ranks = [KVStoreClient(live_server.url, shared_memory_bytes=shm) for _ in range(3)]
    try:
        ranks[0].register_model("m", SPEC)
        tokens = list(range(30))
        kv = random_kv(SPEC, 30, seed=11)
        for r, client in enumerate(ranks):
            if r:
                assert client.lookup("m", tokens).matched_tokens == 0  # nothing until every head is in
            held = client.store("m", tokens, kv[:, :, :, r:r + 1].contiguous(), heads=(r, r + 1))
            assert held.stored_tokens == 30
        assert ranks[0].lookup("m", tokens).matched_tokens == 30
        assert torch.equal(ranks[1].fetch("m", tokens).kv, kv)
        for r, client in enumerate(ranks):
            got = client.fetch("m", tokens, start=4, heads=(r, r + 1))
            assert got.matched_tokens == 30 and got.kv.shape == (2, 2, 26, 1, 8)
            assert torch.equal(got.kv, kv[:, :, 4:, r:r + 1])
        got = ranks[2].fetch("m", tokens, heads=(1, 3), layers=(1, 2))
        assert torch.equal(got.kv, kv[1:2, :, :, 1:3])
        whole = ranks[2].fetch("m", tokens)  # after a sliced fetch, a whole one is sized anew
        assert torch.equal(whole.kv, kv)
    finally:
        for client in ranks:
            client.close()


def test_a_bad_part_is_refused_with_its_field(live_server):
    with KVStoreClient(live_server.url) as client:
        client.register_model("m", SPEC)
        kv = random_kv(SPEC, 8)
        client.store("m", list(range(8)), kv[:, :, :, :2].contiguous(), heads=(0, 2))
        with pytest.raises(PartConflict) as err:
            client.store("m", list(range(8)), kv[:, :, :, 1:].contiguous(), heads=(1, 3))
        assert err.value.status == 409 and "heads" in str(err.value)
        with pytest.raises(InvalidRequest, match="heads"):
            client.store("m", list(range(8)), kv[:, :, :, 1:].contiguous(), heads=(1, 4))
        with pytest.raises(InvalidKV):
            client.store("m", list(range(8)), kv, heads=(2, 3))  # all heads' bytes for one head
        with pytest.raises(InvalidRequest, match="heads"):
            client.fetch("m", list(range(8)), heads=[2])
        # The sidecar is unharmed: the missing head completes the pages.
        client.store("m", list(range(8)), kv[:, :, :, 2:].contiguous(), heads=(2, 3))
        assert torch.equal(client.fetch("m", list(range(8))).kv, kv)


async def test_http_part_errors_are_4xx(http_model):
    status, body = await call(http_model, "POST", "/v1/fetch", {"model": "m", "tokens": [1, 2], "heads": [0, 9]})
    assert status == 400 and body["error"]["message"].startswith("heads:")
    status, body = await call(http_model, "POST", "/v1/fetch", {"model": "m", "tokens": [1, 2], "layers": "x"})
    assert status == 400 and body["error"]["message"].startswith("layers:")
    status, body = await call(http_model, "POST", "/v1/store",
                              {"model": "m", "tokens": [1, 2], "kv": b"\0" * 8, "heads": [0, 1]})
    assert status == 400 and body["error"]["message"].startswith("kv:")
