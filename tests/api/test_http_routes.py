"""The routes of docs/design.md §7.2 through the aiohttp test client, on the real store."""
from __future__ import annotations

import base64

import torch
from api_helpers import call, kv_bin, random_kv, tokens_bin

from kvstore import ModelSpec


async def test_healthz(http):
    assert await call(http, "GET", "/healthz", headers={}) == (200, {"status": "ok"})


async def test_put_model_201_then_200_and_get(http, spec: ModelSpec):
    assert await call(http, "PUT", "/v1/models/llama-3-8b", spec.to_dict()) == (201, spec.to_dict())
    assert await call(http, "PUT", "/v1/models/llama-3-8b", spec.to_dict()) == (200, spec.to_dict())
    assert await call(http, "GET", "/v1/models/llama-3-8b") == (200, spec.to_dict())


async def test_hugging_face_style_model_name_with_a_slash(http, spec: ModelSpec):
    assert (await call(http, "PUT", "/v1/models/meta-llama/Llama-3-8B", spec.to_dict()))[0] == 201
    assert await call(http, "GET", "/v1/models/meta-llama/Llama-3-8B") == (200, spec.to_dict())
    status, body = await call(http, "POST", "/v1/lookup", {"model": "meta-llama/Llama-3-8B", "tokens": [1, 2]})
    assert status == 200 and body["matched_tokens"] == 0
    assert (await call(http, "DELETE", "/v1/models/meta-llama/Llama-3-8B"))[0] == 200


async def test_store_lookup_fetch_roundtrip_with_bin_tokens(http_model, spec: ModelSpec):
    tokens = list(range(100, 110))
    kv = random_kv(spec, 10)
    status, body = await call(http_model, "POST", "/v1/store",
                              {"model": "m", "tokens": tokens_bin(tokens), "kv": kv_bin(kv)})
    assert status == 200 and body == {"stored_tokens": 10, "new_pages": 3}
    status, body = await call(http_model, "POST", "/v1/lookup", {"model": "m", "tokens": tokens + [1, 2]})
    assert status == 200 and body["matched_tokens"] == 10 and sum(body["tiers"].values()) == 10
    status, body = await call(http_model, "POST", "/v1/fetch",
                              {"model": "m", "tokens": tokens_bin(tokens + [7]), "start": 3})
    assert status == 200 and body["matched_tokens"] == 10
    assert body["shape"] == list(spec.kv_shape(7)) and body["dtype"] == "float16"
    got = torch.frombuffer(bytearray(body["kv"]), dtype=torch.float16).view(spec.kv_shape(7))
    assert torch.equal(got, kv[:, :, 3:])


async def test_store_with_start_extends_a_prefix(http_model, spec: ModelSpec):
    kv = random_kv(spec, 8)
    await call(http_model, "POST", "/v1/store", {"model": "m", "tokens": list(range(4)), "kv": kv_bin(kv[:, :, :4])})
    status, body = await call(http_model, "POST", "/v1/store",
                              {"model": "m", "tokens": list(range(8)), "kv": kv_bin(kv[:, :, 4:]), "start": 4})
    assert status == 200 and body["stored_tokens"] == 8
    status, body = await call(http_model, "POST", "/v1/fetch", {"model": "m", "tokens": list(range(8))})
    assert torch.equal(torch.frombuffer(bytearray(body["kv"]), dtype=torch.float16).view(spec.kv_shape(8)), kv)


async def test_fetch_miss_returns_no_kv(http_model):
    status, body = await call(http_model, "POST", "/v1/fetch", {"model": "m", "tokens": [5, 6, 7]})
    assert status == 200 and body["matched_tokens"] == 0 and not body["kv"]


async def test_json_request_is_decoded_and_answered_in_json(http_model, spec: ModelSpec):
    kv = random_kv(spec, 4)
    json_headers = {"Content-Type": "application/json"}
    http = http_model
    resp = await http.post("/v1/store", json={"model": "m", "tokens": [1, 2, 3, 4],
                                              "kv": base64.b64encode(kv_bin(kv)).decode()}, headers=json_headers)
    assert resp.status == 200 and (await resp.json())["stored_tokens"] == 4
    resp = await http.post("/v1/fetch", json={"model": "m", "tokens": [1, 2, 3, 4]}, headers=json_headers)
    body = await resp.json()
    assert resp.status == 200 and body["matched_tokens"] == 4
    fetched = torch.frombuffer(bytearray(base64.b64decode(body["kv"])), dtype=torch.float16).view(kv.shape)
    assert torch.equal(fetched, kv)


async def test_bfloat16_model_roundtrip(http):
    spec = ModelSpec(num_layers=1, num_kv_heads=1, head_dim=4, dtype="bfloat16", page_size=2)
    await call(http, "PUT", "/v1/models/bf", spec.to_dict())
    kv = random_kv(spec, 3)
    await call(http, "POST", "/v1/store", {"model": "bf", "tokens": [1, 2, 3], "kv": kv_bin(kv)})
    status, body = await call(http, "POST", "/v1/fetch", {"model": "bf", "tokens": [1, 2, 3]})
    assert torch.equal(torch.frombuffer(bytearray(body["kv"]), dtype=torch.bfloat16).view(kv.shape), kv)


async def test_delete_model_drops_pages(http_model, spec: ModelSpec):
    await call(http_model, "POST", "/v1/store",
               {"model": "m", "tokens": list(range(8)), "kv": kv_bin(random_kv(spec, 8))})
    status, body = await call(http_model, "DELETE", "/v1/models/m")
    assert status == 200 and body["dropped_pages"] == 2
    assert (await call(http_model, "POST", "/v1/lookup", {"model": "m", "tokens": [0]}))[0] == 404


async def test_stats_is_json_per_tier(http_model, spec: ModelSpec):
    await call(http_model, "POST", "/v1/store",
               {"model": "m", "tokens": list(range(8)), "kv": kv_bin(random_kv(spec, 8))})
    status, body = await call(http_model, "GET", "/v1/stats", headers={})
    assert status == 200 and body["tiers"]["cpu"]["pages"] == 2
    assert {"pages", "bytes", "capacity_bytes", "hits", "misses", "evictions"} <= set(body["tiers"]["cpu"])
