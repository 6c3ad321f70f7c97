"""Bad input gets a 4xx whose message names the field; never a 500, never a partial store."""
from __future__ import annotations

import json

import msgpack
import pytest
from api_helpers import MAX_BODY_BYTES, call, kv_bin, random_kv, tokens_bin

from kvstore import ModelSpec


def assert_error(result: tuple[int, object], status: int, code: str, field: str) -> None:
    got_status, body = result
    assert got_status == status, body
    assert isinstance(body, dict) and body["error"]["code"] == code, body
    assert field in body["error"]["message"], body


async def assert_nothing_stored(http, tokens: list[int]) -> None:
    status, body = await call(http, "POST", "/v1/lookup", {"model": "m", "tokens": tokens})
    assert status == 200 and body["matched_tokens"] == 0


@pytest.mark.parametrize("raw, reason", [
    (b"\xc1", "invalid type byte"),
    (b"\x82\xa5model\xa1m", "truncated map"),
    (b"\x93\x01\x02\x03", "array, not a map"),
    (b"", "empty body"),
    (b"\x81\xa5model\xa1m\xff\xff", "trailing bytes"),
    (b"\x81\x01\xa1m", "int key"),
    (b"\x81\x91\x01\x01", "array key"),
    (b"\x81\xa5model\x81\x91\x01\x01", "nested map with an array key (unhashable)"),
])
async def test_malformed_msgpack_is_400(http_model, raw: bytes, reason: str):
    assert_error(await call(http_model, "POST", "/v1/lookup", raw=raw), 400, "invalid_request", "body")


async def test_json_sent_as_msgpack_is_400(http_model):
    raw = json.dumps({"model": "m", "tokens": [1, 2]}).encode()
    assert_error(await call(http_model, "POST", "/v1/lookup", raw=raw), 400, "invalid_request", "body")


async def test_unsupported_content_type_is_415(http_model):
    result = await call(http_model, "POST", "/v1/lookup", raw=b"model=m",
                        headers={"Content-Type": "text/plain", "Accept": "application/msgpack"})
    assert_error(result, 415, "unsupported_media_type", "Content-Type")


async def test_malformed_json_is_400_in_json(http_model):
    result = await call(http_model, "POST", "/v1/lookup", raw=b"{not json",
                        headers={"Content-Type": "application/json"})
    assert_error(result, 400, "invalid_request", "body")


@pytest.mark.parametrize("body, code, field", [
    ({"tokens": [1]}, "invalid_model_name", "model"),
    ({"model": "m"}, "invalid_tokens", "tokens"),
    ({"model": 7, "tokens": [1]}, "invalid_model_name", "model"),
    ({"model": "m", "tokens": "1 2 3"}, "invalid_tokens", "tokens"),
    ({"model": "m", "tokens": [1, 2.5]}, "invalid_tokens", "tokens[1]"),
    ({"model": "m", "tokens": [1, True]}, "invalid_tokens", "tokens[1]"),
    ({"model": "m", "tokens": [1, -3]}, "invalid_tokens", "tokens[1]"),
    ({"model": "m", "tokens": [1, 1 << 40]}, "invalid_tokens", "tokens[1]"),
    ({"model": "m", "tokens": b"\x01\x00\x00"}, "invalid_tokens", "tokens"),
    ({"model": "m", "tokens": b"\xff\xff\xff\xff"}, "invalid_tokens", "tokens"),
    ({"model": "m", "tokens": [1], "color": "red"}, "invalid_request", "color"),
    ({"model": "bad name!", "tokens": [1]}, "invalid_model_name", "model"),
])
async def test_bad_lookup_fields_name_the_field(http_model, body, code, field):
    assert_error(await call(http_model, "POST", "/v1/lookup", body), 400, code, field)


@pytest.mark.parametrize("start, field",
                         [(-1, "start"), (99, "start"), ("2", "start"), (1.5, "start"), (True, "start")])
async def test_bad_start_is_400(http_model, start, field):
    assert_error(await call(http_model, "POST", "/v1/fetch", {"model": "m", "tokens": [1, 2], "start": start}),
                 400, "invalid_start", field)


async def test_kv_of_wrong_length_is_400_and_stores_nothing(http_model, spec: ModelSpec):
    tokens = list(range(8))
    short = kv_bin(random_kv(spec, 8))[:-2]
    result = await call(http_model, "POST", "/v1/store", {"model": "m", "tokens": tokens_bin(tokens), "kv": short})
    assert_error(result, 400, "invalid_kv", "kv")
    assert str(spec.bytes_per_token) in result[1]["error"]["message"]
    await assert_nothing_stored(http_model, tokens)


@pytest.mark.parametrize("kv, field", [([1, 2, 3], "kv"), ("AAAA", "kv"), (None, "kv")])
async def test_kv_not_bin_is_400(http_model, kv, field):
    result = await call(http_model, "POST", "/v1/store", {"model": "m", "tokens": [1], "kv": kv})
    assert_error(result, 400, "invalid_kv", field)


async def test_kv_missing_is_400(http_model):
    assert_error(await call(http_model, "POST", "/v1/store", {"model": "m", "tokens": [1]}), 400, "invalid_kv", "kv")


async def test_kv_dtype_mismatch_is_400(http_model, spec: ModelSpec):
    kv = kv_bin(random_kv(spec, 2))
    result = await call(http_model, "POST", "/v1/store",
                        {"model": "m", "tokens": [1, 2], "kv": kv, "dtype": "bfloat16"})
    assert_error(result, 400, "invalid_kv", "dtype")
    await assert_nothing_stored(http_model, [1, 2])


async def test_store_start_beyond_what_is_cached_stores_nothing(http_model, spec: ModelSpec):
    # kv for tokens[4:] of a prefix the store does not hold
    result = await call(http_model, "POST", "/v1/store",
                        {"model": "m", "tokens": list(range(8)), "kv": kv_bin(random_kv(spec, 4)), "start": 4})
    assert result[0] in (200, 400)
    await assert_nothing_stored(http_model, list(range(8)))


@pytest.mark.parametrize("method, path, body", [
    ("POST", "/v1/lookup", {"model": "nope", "tokens": [1]}),
    ("POST", "/v1/fetch", {"model": "nope", "tokens": [1]}),
    ("POST", "/v1/store", {"model": "nope", "tokens": [1], "kv": b"\x00" * 4}),
    ("GET", "/v1/models/nope", None),
    ("DELETE", "/v1/models/nope", None),
])
async def test_unknown_model_is_404(http_model, method, path, body):
    assert_error(await call(http_model, method, path, body), 404, "model_not_found", "nope")


async def test_conflicting_spec_is_409(http_model, spec: ModelSpec):
    other = ModelSpec(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)
    assert_error(await call(http_model, "PUT", "/v1/models/m", other.to_dict()), 409, "model_conflict", "m")
    assert await call(http_model, "GET", "/v1/models/m") == (200, spec.to_dict())


@pytest.mark.parametrize("body, field", [
    ({"num_layers": 2, "num_kv_heads": 2}, "head_dim"),
    ({"num_layers": 0, "num_kv_heads": 2, "head_dim": 8}, "num_layers"),
    ({"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "dtype": "int4"}, "dtype"),
    ({"num_layers": 2, "num_kv_heads": 2, "head_dim": 8, "flavor": 1}, "flavor"),
    ({"num_layers": "2", "num_kv_heads": 2, "head_dim": 8}, "num_layers"),
])
async def test_bad_spec_is_400(http, body, field):
    assert_error(await call(http, "PUT", "/v1/models/x", body), 400, "invalid_model_spec", field)
    assert (await call(http, "GET", "/v1/models/x"))[0] == 404


async def test_bad_model_name_in_path_is_400(http, spec: ModelSpec):
    assert_error(await call(http, "PUT", "/v1/models/-dash-first", spec.to_dict()), 400, "invalid_model_name", "model")


async def test_body_over_limit_is_413(http_model, spec: ModelSpec):
    big = b"\x00" * (MAX_BODY_BYTES + 1)
    result = await call(http_model, "POST", "/v1/store", {"model": "m", "tokens": [1], "kv": big})
    assert_error(result, 413, "payload_too_large", "body")


async def test_chunked_body_over_limit_is_413(http_model):
    async def chunks():
        for _ in range(MAX_BODY_BYTES // 65536 + 2):
            yield b"\x00" * 65536

    result = await call(http_model, "POST", "/v1/store", raw=chunks())  # type: ignore[arg-type]
    assert_error(result, 413, "payload_too_large", "body")


async def test_unknown_route_and_method_get_the_error_shape(http):
    assert_error(await call(http, "GET", "/v1/nothing"), 404, "not_found", "/v1/nothing")
    assert_error(await call(http, "GET", "/v1/lookup"), 405, "method_not_allowed", "/v1/lookup")


async def test_errors_answer_json_when_asked(http_model):
    resp = await http_model.post("/v1/lookup", data=msgpack.packb({"model": "m"}),
                                 headers={"Content-Type": "application/msgpack", "Accept": "application/json"})
    assert resp.status == 400 and (await resp.json())["error"]["code"] == "invalid_tokens"
