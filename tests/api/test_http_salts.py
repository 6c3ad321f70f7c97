"""Salts through the sidecar: a salted request hits what it stored under its salt, on a sidecar
without an auth file (the default tenant) and inside each bearer token's tenant, over the fast
path, aiohttp's routes, shared memory and a plain body; a bad salt is a 400 naming `salt`."""
from __future__ import annotations

import json

import pytest
import torch
from api_helpers import MAX_BODY_BYTES, MSGPACK, LiveServer, call, kv_bin, random_kv, sidecar_client

from kvstore import KVStoreClient
from kvstore.errors import InvalidRequest
from kvstore.api.server.config import ServerConfig

TOKENS = list(range(10, 22))  # three full pages of the fixture's spec


@pytest.mark.parametrize("shared_memory_bytes", [0, 1 << 20])
def test_a_salted_client_hits_its_own_salt_on_a_sidecar_without_auth(store, spec, shared_memory_bytes):
    server = LiveServer(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES))
    try:
        with KVStoreClient(server.url, shared_memory_bytes=shared_memory_bytes) as client:
            client.register_model("m", spec)
            kv = random_kv(spec, 12)
            assert client.store("m", TOKENS, kv, salt="s1").stored_tokens == 12
            assert client.lookup("m", TOKENS, salt="s1").matched_tokens == 12
            got = client.fetch("m", TOKENS, salt="s1")
            assert got.matched_tokens == 12 and torch.equal(got.kv, kv)
            assert torch.equal(client.fetch("m", TOKENS, start=4, salt="s1").kv, kv[:, :, 4:])
            for other in (None, "s2"):
                assert client.lookup("m", TOKENS, salt=other).matched_tokens == 0
                assert client.fetch("m", TOKENS, salt=other).matched_tokens == 0
            # The unsalted prompt stored after it is a tree of its own: the salt's KV is unchanged.
            plain = random_kv(spec, 12)
            client.store("m", TOKENS, plain)
            assert torch.equal(client.fetch("m", TOKENS).kv, plain)
            assert torch.equal(client.fetch("m", TOKENS, salt="s1").kv, kv)
    finally:
        server.close()


def test_salted_chunks_and_blends_through_the_sidecar(store, spec):
    server = LiveServer(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES))
    try:
        with KVStoreClient(server.url, shared_memory_bytes=0) as client:
            client.register_model("m", spec)
            chunk = list(range(40, 48))
            client.store_chunk("m", chunk, random_kv(spec, 8), salt="s")
            assert client.blend("m", [chunk], salt="s").hits == [True]
            assert client.blend("m", [chunk]).hits == [False]
    finally:
        server.close()


async def test_the_same_salt_in_two_tenants_shares_nothing(store, spec, tmp_path):
    path = tmp_path / "auth.json"
    path.write_text(json.dumps({"secret-alice-0123456789": "alice", "secret-bob-0123456789": "bob"}))
    alice = {**MSGPACK, "Authorization": "Bearer secret-alice-0123456789"}
    bob = {**MSGPACK, "Authorization": "Bearer secret-bob-0123456789"}
    async with sidecar_client(store, ServerConfig(auth_file=str(path))) as http:
        for who in (alice, bob):
            assert (await call(http, "PUT", "/v1/models/m", spec.to_dict(), headers=who))[0] == 201
        body = {"model": "m", "tokens": TOKENS, "kv": kv_bin(random_kv(spec, 12)), "salt": "s"}
        assert (await call(http, "POST", "/v1/store", body, headers=alice))[0] == 200
        lookup = {"model": "m", "tokens": TOKENS, "salt": "s"}
        status, answer = await call(http, "POST", "/v1/lookup", lookup, headers=alice)
        assert status == 200 and answer["matched_tokens"] == 12
        status, answer = await call(http, "POST", "/v1/lookup", lookup, headers=bob)
        assert status == 200 and answer["matched_tokens"] == 0
    assert store.stats()["tenants"]["alice"]["bytes"]["cpu"] > 0


@pytest.mark.parametrize("salt", ["", 7, ["s"], {"s": 1}, "x" * 1025, True])
@pytest.mark.parametrize("route", ["/v1/lookup", "/v1/fetch", "/v1/store", "/v1/blend"])
async def test_a_bad_salt_is_a_400_naming_salt(http_model, spec, store, route, salt):
    body = {"model": "m", "salt": salt}
    body.update({"chunks": [TOKENS]} if route == "/v1/blend" else {"tokens": TOKENS})
    if route == "/v1/store":
        body["kv"] = kv_bin(random_kv(spec, 12))
    status, answer = await call(http_model, "POST", route, body)
    assert status == 400 and "salt" in answer["error"]["message"], answer
    assert store.stats()["tiers"]["cpu"]["pages"] == 0


async def test_a_salt_in_json_works_like_msgpack(http_model, spec):
    body = {"model": "m", "tokens": TOKENS, "kv": kv_bin(random_kv(spec, 12)), "salt": "conv-7"}
    assert (await call(http_model, "POST", "/v1/store", body))[0] == 200
    resp = await http_model.post("/v1/lookup", data=json.dumps({"model": "m", "tokens": TOKENS, "salt": "conv-7"}),
                                 headers={"Content-Type": "application/json"})
    assert resp.status == 200 and (await resp.json())["matched_tokens"] == 12


def test_the_client_refuses_a_bad_salt_before_sending(store, spec):
    server = LiveServer(store, ServerConfig(max_body_bytes=MAX_BODY_BYTES))
    try:
        with KVStoreClient(server.url, shared_memory_bytes=0) as client:
            client.register_model("m", spec)
            with pytest.raises(InvalidRequest, match="salt"):
                client.lookup("m", TOKENS, salt="")
            assert store.stats()["lookups"] == 0
    finally:
        server.close()
