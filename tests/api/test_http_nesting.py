"""Bodies nested deeper than any request can be (JSON and msgpack, at the top, inside `tokens`,
`chunks` or `shm`) get 400 naming the body, on every route that takes one; never a 500, and the
sidecar serves normally afterwards."""
from __future__ import annotations

import json
import random

import msgpack
import pytest
from api_helpers import call, kv_bin, random_kv, tokens_bin

from kvstore import ModelSpec
from kvstore.api.server.wire import MAX_BODY_DEPTH, decode_json, decode_msgpack
from kvstore.errors import InvalidRequest

ROUTES = [("POST", "/v1/lookup"), ("POST", "/v1/store"), ("POST", "/v1/fetch"), ("POST", "/v1/chunks/store"),
          ("POST", "/v1/blend"), ("POST", "/v1/shm"), ("PUT", "/v1/models/m2")]
DEPTHS = [100, 1_000, 10_000, 100_000]
JSON_HEADERS = {"Content-Type": "application/json", "Accept": "application/json"}
MSGPACK_HEADERS = {"Content-Type": "application/msgpack", "Accept": "application/msgpack"}


def json_bombs(depth: int) -> dict[str, bytes]:
    return {
        "arrays": b"[" * depth + b"]" * depth,
        "maps": b'{"a":' * depth + b"1" + b"}" * depth,
        "unclosed arrays": b"[" * depth,
        "in tokens": b'{"model": "m", "tokens": ' + b"[" * depth + b"1" + b"]" * depth + b"}",
        "in chunks": b'{"model": "m", "chunks": [' + b"[" * depth + b"]" * depth + b"]}",
        "in shm": b'{"model": "m", "tokens": [1], "shm": ' + b'{"a":' * depth + b"0" + b"}" * depth + b"}",
    }


def msgpack_bombs(depth: int) -> dict[str, bytes]:
    return {
        "arrays": b"\x91" * depth + b"\x01",
        "maps": b"\x81\xa1a" * depth + b"\x01",
        "in tokens": b"\x82\xa5model\xa1m\xa6tokens" + b"\x91" * depth + b"\x01",
        "maps in tokens": b"\x82\xa5model\xa1m\xa6tokens" + b"\x81\xa1a" * depth + b"\x01",
        "in chunks": b"\x82\xa5model\xa1m\xa6chunks" + b"\x91" * depth + b"\x01",
        "in shm": b"\x83\xa5model\xa1m\xa6tokens\x91\x01\xa3shm" + b"\x81\xa6offset" * depth + b"\x00",
        # a map of 2**16 entries header, then deep nesting: the large-body walker's path
        "long body, deep": b"\x83\xa5model\xa1m\xa2kv\xc6" + (70_000).to_bytes(4, "big") + bytes(70_000)
                           + b"\xa6tokens" + b"\x91" * depth + b"\x01",
    }


def assert_nesting_refused(result: tuple[int, object], why: tuple[str, ...] = ("body: nested deeper than",)) -> None:
    status, body = result
    assert status == 400, (status, body)
    assert isinstance(body, dict) and body["error"]["code"] == "invalid_request", body
    assert any(reason in body["error"]["message"] for reason in why), body


async def assert_healthy(http, spec: ModelSpec) -> None:
    status, body = await call(http, "GET", "/healthz", headers=JSON_HEADERS)
    assert status == 200 and body == {"status": "ok"}
    tokens = list(range(spec.page_size * 2))
    kv = random_kv(spec, len(tokens))
    status, body = await call(http, "POST", "/v1/store", {"model": "m", "tokens": tokens_bin(tokens), "kv": kv_bin(kv)})
    assert status == 200 and body["stored_tokens"] == len(tokens), body
    status, body = await call(http, "POST", "/v1/fetch", {"model": "m", "tokens": tokens_bin(tokens)})
    assert status == 200 and body["matched_tokens"] == len(tokens) and body["kv"] == kv_bin(kv)


@pytest.mark.parametrize("depth", DEPTHS)
async def test_json_nesting_bombs_are_400_on_every_route(http_model, spec, depth):
    for method, path in ROUTES:
        for name, raw in json_bombs(depth).items():
            result = await call(http_model, method, path, raw=raw, headers=JSON_HEADERS)
            assert_nesting_refused(result)
    await assert_healthy(http_model, spec)


@pytest.mark.parametrize("depth", DEPTHS)
async def test_msgpack_nesting_bombs_are_400_on_every_route(http_model, spec, depth):
    for method, path in ROUTES:
        for name, raw in msgpack_bombs(depth).items():
            result = await call(http_model, method, path, raw=raw, headers=MSGPACK_HEADERS)
            # a bomb that is not a map at all may be refused for that first
            if name == "arrays":
                allowed = ("body: nested deeper than", "body: expected a msgpack map")
            else:
                allowed = ("body: nested deeper than",)
            assert_nesting_refused(result, allowed)
    await assert_healthy(http_model, spec)


async def test_random_mixes_of_brackets_and_keys_are_never_5xx(http_model, spec):
    rng = random.Random(16)
    pieces = [b"[", b"{", b'"a":', b"]", b"}", b",", b"1", b'"', b"\\"]
    weights = [30, 30, 30, 3, 3, 2, 1, 1, 1]
    for trial in range(120):
        raw = b"".join(rng.choices(pieces, weights, k=rng.choice([5, 100, 1_000, 20_000])))
        method, path = ROUTES[trial % len(ROUTES)]
        status, body = await call(http_model, method, path, raw=raw, headers=JSON_HEADERS)
        assert status == 400 and body["error"]["code"] == "invalid_request", (raw[:80], status, body)
    await assert_healthy(http_model, spec)


def test_the_deepest_request_of_the_schema_decodes():
    """chunks and rope_scaling's lists sit MAX_BODY_DEPTH containers deep: they are requests, not bombs."""
    blend = {"model": "m", "chunks": [[1, 2], [3]], "note": "[[[[{{{{ inside a string, \" and \\ too"}
    assert decode_json(bytearray(json.dumps(blend).encode())) == blend
    assert decode_msgpack(bytearray(msgpack.packb(blend)))["chunks"] == [[1, 2], [3]]
    spec = {"num_layers": 1, "num_kv_heads": 1, "head_dim": 8,
            "rope_scaling": {"rope_type": "longrope", "long_factor": [1.0, 2.0]}}
    assert decode_json(bytearray(json.dumps(spec).encode())) == spec
    one_deeper = {"model": "m", "chunks": [[[1]]]}
    for decoded in (lambda: decode_json(bytearray(json.dumps(one_deeper).encode())),
                    lambda: decode_msgpack(bytearray(msgpack.packb(one_deeper)))):
        with pytest.raises(InvalidRequest, match=f"nested deeper than {MAX_BODY_DEPTH} levels"):
            decoded()


async def test_nested_values_in_error_messages_stay_short(http_model):
    """A value as deep as the schema allows, in the wrong field, is named without printing it whole."""
    status, body = await call(http_model, "POST", "/v1/lookup", {"model": "m", "tokens": [list(range(10_000))]})
    assert status == 400 and body["error"]["code"] == "invalid_tokens"
    assert len(body["error"]["message"]) < 200
