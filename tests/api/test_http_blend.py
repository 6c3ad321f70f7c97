"""CacheBlend over HTTP: POST /v1/chunks/store and POST /v1/blend, status codes and bad input,
and both clients' store_chunk / blend returning what the in-process store returns."""
from __future__ import annotations

import pytest
import torch
from api_helpers import call, kv_bin, random_kv, tokens_bin

from kvstore.api.client import AsyncKVStoreClient, KVStoreClient
from kvstore import KVStore, ModelSpec
from kvstore.errors import InvalidKV, InvalidStart, InvalidTokens, ModelNotFound, Unsupported
from kvstore.results import BlendResult, StoreResult


def kv_of(body: dict, spec: ModelSpec, n: int) -> torch.Tensor:
    return torch.frombuffer(bytearray(body["kv"]), dtype=torch.float16).view(spec.kv_shape(n))  # (L, 2, n, H, D)


async def test_chunk_store_then_blend_at_a_new_position(http_model, store: KVStore, spec: ModelSpec):
    kv = random_kv(spec, 6)
    status, body = await call(http_model, "POST", "/v1/chunks/store",
                              {"model": "m", "tokens": tokens_bin(list(range(20, 26))), "kv": kv_bin(kv)})
    assert status == 200 and body["stored_tokens"] == 6
    status, body = await call(http_model, "POST", "/v1/blend",
                              {"model": "m", "chunks": [[1, 2, 3], tokens_bin(list(range(20, 26)))], "start_pos": 10})
    assert status == 200 and body["hits"] == [False, True] and body["positions"] == [[10, 13], [13, 19]]
    assert body["shape"] == list(spec.kv_shape(9)) and body["dtype"] == "float16"
    got = kv_of(body, spec, 9)
    assert torch.equal(got, store.blend("m", [[1, 2, 3], list(range(20, 26))], start_pos=10).kv)
    assert not got[:, :, :3].any() and torch.equal(got[:, 1, 3:], kv[:, 1])


@pytest.mark.parametrize("path,body,status,code", [
    ("/v1/blend", {"model": "m"}, 400, "invalid_request"),
    ("/v1/blend", {"model": "m", "chunks": []}, 400, "invalid_tokens"),
    ("/v1/blend", {"model": "m", "chunks": "x"}, 400, "invalid_tokens"),
    ("/v1/blend", {"model": "m", "chunks": [[1, "a"]]}, 400, "invalid_tokens"),
    ("/v1/blend", {"model": "m", "chunks": [[]]}, 400, "invalid_tokens"),
    ("/v1/blend", {"model": "m", "chunks": [[1]], "start_pos": -3}, 400, "invalid_start"),
    ("/v1/blend", {"model": "m", "chunks": [[1]], "extra": 1}, 400, "invalid_request"),
    ("/v1/blend", {"model": "nope", "chunks": [[1]]}, 404, "model_not_found"),
    ("/v1/chunks/store", {"model": "m", "tokens": [1, 2]}, 400, "invalid_kv"),
    ("/v1/chunks/store", {"model": "m", "tokens": [1, 2], "kv": b"\0" * 10}, 400, "invalid_kv"),
    ("/v1/chunks/store", {"model": "m", "tokens": [1, 2], "kv": b"", "start": 1}, 400, "invalid_request"),
    ("/v1/chunks/store", {"model": "nope", "tokens": [1], "kv": b""}, 404, "model_not_found"),
])
async def test_bad_input_is_a_4xx_naming_the_field(http_model, path: str, body: dict, status: int, code: str):
    got, answer = await call(http_model, "POST", path, body)
    assert got == status and answer["error"]["code"] == code, answer


async def test_rope_that_cannot_be_rerotated_is_422(http):
    spec = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16", page_size=4,
                     rope_scaling={"rope_type": "dynamic", "factor": 2.0})
    assert (await call(http, "PUT", "/v1/models/d", spec.to_dict()))[0] == 201
    status, body = await call(http, "POST", "/v1/blend", {"model": "d", "chunks": [[1, 2]], "start_pos": 4})
    assert status == 422 and body["error"]["code"] == "unsupported" and "dynamic" in body["error"]["message"]


def test_sync_client_store_chunk_and_blend(live_server, store: KVStore, spec: ModelSpec):
    with KVStoreClient(live_server.url) as client:
        client.register_model("m", spec)
        kv = random_kv(spec, 5, seed=2)
        assert client.store_chunk("m", [9, 8, 7, 6, 5], kv) == StoreResult(stored_tokens=5, new_pages=2)
        got = client.blend("m", [[9, 8, 7, 6, 5], [1]], start_pos=3)
        want = store.blend("m", [[9, 8, 7, 6, 5], [1]], start_pos=3)
        assert isinstance(got, BlendResult) and got.hits == want.hits == [True, False]
        assert got.positions == want.positions == [(3, 8), (8, 9)] and torch.equal(got.kv, want.kv)
        with pytest.raises(InvalidTokens):
            client.blend("m", [])
        with pytest.raises(InvalidStart):
            client.blend("m", [[1]], start_pos=-1)
        with pytest.raises(InvalidKV):
            client.store_chunk("m", [1, 2], random_kv(spec, 3))
        with pytest.raises(ModelNotFound):
            client.blend("nope", [[1]])


async def test_async_client_store_chunk_and_blend(live_server, spec: ModelSpec):
    async with AsyncKVStoreClient(live_server.url) as client:
        await client.register_model("m", spec)
        kv = random_kv(spec, 4, seed=3)
        assert (await client.store_chunk("m", [4, 3, 2, 1], kv)).stored_tokens == 4
        got = await client.blend("m", [[4, 3, 2, 1]])
        assert got.hits == [True] and got.positions == [(0, 4)] and torch.equal(got.kv, kv)


def test_sync_client_unsupported_rope_raises_unsupported(live_server):
    spec = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype="float16", page_size=4,
                     rope_scaling={"rope_type": "yarn", "factor": 2.0})
    with KVStoreClient(live_server.url) as client:
        client.register_model("y", spec)
        with pytest.raises(Unsupported):
            client.blend("y", [[1]], start_pos=1)
