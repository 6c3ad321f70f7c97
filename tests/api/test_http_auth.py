"""Bearer tokens map to tenants; tenants never see each other's models or pages."""
from __future__ import annotations

import json

import pytest
from api_helpers import MSGPACK, call, kv_bin, random_kv, sidecar_client

from kvstore.api.server.auth import find_tenant, load_auth_file
from kvstore.api.server.config import ServerConfig
from kvstore import ModelSpec

TOKENS = {"secret-alice-0123456789": "alice", "secret-bob-0123456789": "bob"}


@pytest.fixture
async def authed(store, tmp_path):
    path = tmp_path / "auth.json"
    path.write_text(json.dumps(TOKENS))
    async with sidecar_client(store, ServerConfig(auth_file=str(path))) as client:
        yield client


def as_(tenant_token: str) -> dict[str, str]:
    return {**MSGPACK, "Authorization": f"Bearer {tenant_token}"}


@pytest.mark.parametrize("authorization",
                         [None, "", "Bearer", "Bearer wrong", "Basic c2VjcmV0", "secret-alice-0123456789"])
async def test_missing_or_unknown_token_is_401(authed, spec: ModelSpec, authorization):
    headers = dict(MSGPACK) if authorization is None else {**MSGPACK, "Authorization": authorization}
    status, body = await call(authed, "PUT", "/v1/models/m", spec.to_dict(), headers=headers)
    assert status == 401 and body["error"]["code"] == "unauthorized" and "Authorization" in body["error"]["message"]


async def test_open_routes_need_no_token(authed):
    assert (await call(authed, "GET", "/healthz", headers={}))[0] == 200
    assert (await call(authed, "GET", "/openapi.json", headers={}))[0] == 200
    assert (await call(authed, "GET", "/metrics", headers={}))[0] == 200


async def test_tenants_are_isolated(authed, spec: ModelSpec):
    alice, bob = as_("secret-alice-0123456789"), as_("secret-bob-0123456789")
    assert (await call(authed, "PUT", "/v1/models/m", spec.to_dict(), headers=alice))[0] == 201
    kv = random_kv(spec, 4)
    store_request = {"model": "m", "tokens": [1, 2, 3, 4], "kv": kv_bin(kv)}
    assert (await call(authed, "POST", "/v1/store", store_request, headers=alice))[0] == 200
    lookup = {"model": "m", "tokens": [1, 2, 3, 4]}
    status, body = await call(authed, "POST", "/v1/lookup", lookup, headers=bob)
    assert status == 404 and body["error"]["code"] == "model_not_found"
    # Bob registering the same name gets his own, empty namespace.
    assert (await call(authed, "PUT", "/v1/models/m", spec.to_dict(), headers=bob))[0] == 201
    assert (await call(authed, "POST", "/v1/lookup", lookup, headers=bob))[1]["matched_tokens"] == 0
    assert (await call(authed, "POST", "/v1/lookup", lookup, headers=alice))[1]["matched_tokens"] == 4


def test_find_tenant_and_bad_auth_files(tmp_path):
    table = {b"tok-a": "a", b"tok-b": "b"}
    assert find_tenant(table, b"tok-b") == "b" and find_tenant(table, b"tok-") is None
    for text in ("[]", "{}", '{"tok": ""}', "not json"):
        (tmp_path / "auth.json").write_text(text)
        with pytest.raises(ValueError, match="auth_file"):
            load_auth_file(str(tmp_path / "auth.json"))
    with pytest.raises(ValueError, match="auth_file: cannot read"):
        load_auth_file(str(tmp_path / "missing.json"))


async def test_auth_file_max_bytes_caps_a_tenant(store, tmp_path, spec: ModelSpec):
    path = tmp_path / "auth.json"
    path.write_text(json.dumps({"secret-alice-0123456789": {"tenant": "alice", "max_bytes": "8KiB"},
                                "secret-bob-0123456789": "bob"}))
    alice, bob = as_("secret-alice-0123456789"), as_("secret-bob-0123456789")
    async with sidecar_client(store, ServerConfig(auth_file=str(path))) as http:
        for who in (alice, bob):
            assert (await call(http, "PUT", "/v1/models/m", spec.to_dict(), headers=who))[0] == 201
        seqs = [[i * 1000 + t for t in range(8)] for i in range(40)]
        for tokens in seqs[:2]:
            store_request = {"model": "m", "tokens": tokens, "kv": kv_bin(random_kv(spec, 8))}
            assert (await call(http, "POST", "/v1/store", store_request, headers=bob))[0] == 200
        for tokens in seqs[2:]:  # alice stores far past 8 KiB
            store_request = {"model": "m", "tokens": tokens, "kv": kv_bin(random_kv(spec, 8))}
            assert (await call(http, "POST", "/v1/store", store_request, headers=alice))[0] == 200
        status, stats = await call(http, "GET", "/v1/stats", headers=alice)
        assert status == 200 and stats["tenants"]["alice"]["max_bytes"] == 8 << 10
        assert 0 < stats["tenants"]["alice"]["bytes"]["cpu"] <= 8 << 10
        assert "secret" not in json.dumps(stats)  # tenant names only, never tokens
        lookup = {"model": "m", "tokens": seqs[-1]}
        assert (await call(http, "POST", "/v1/lookup", lookup, headers=alice))[1]["tiers"] == {"cpu": 8}
        lookup = {"model": "m", "tokens": seqs[2]}  # alice's oldest: moved down to disk, still served
        assert (await call(http, "POST", "/v1/lookup", lookup, headers=alice))[1]["tiers"] == {"disk": 8}
        for tokens in seqs[:2]:
            lookup = {"model": "m", "tokens": tokens}
            assert (await call(http, "POST", "/v1/lookup", lookup, headers=bob))[1]["tiers"] == {"cpu": 8}


@pytest.mark.parametrize("entry, message", [
    ({"tenant": "a", "max_bytes": "lots"}, "entry 1 \\(tenant 'a'\\): max_bytes"),
    ({"tenant": "a", "max_bytes": 0}, "entry 1 \\(tenant 'a'\\): max_bytes must be > 0"),
    ({"max_bytes": "1GiB"}, "entry 1: every token needs a non-empty tenant"),
    ({"tenant": "a", "quota": "1GiB"}, "entry 1: unknown keys \\['quota'\\]"),
])
def test_bad_max_bytes_entries_name_the_entry_not_the_token(tmp_path, entry, message):
    (tmp_path / "auth.json").write_text(json.dumps({"tok-secret-xyz": entry}))
    with pytest.raises(ValueError, match=message) as err:
        load_auth_file(str(tmp_path / "auth.json"))
    assert "tok-secret-xyz" not in str(err.value)


def test_same_tenant_needs_one_max_bytes(tmp_path):
    (tmp_path / "auth.json").write_text(json.dumps({"t1": {"tenant": "a", "max_bytes": "1GiB"},
                                                    "t2": {"tenant": "a", "max_bytes": "2GiB"}, "t3": "a"}))
    with pytest.raises(ValueError, match="entry 2 \\(tenant 'a'\\): max_bytes differs"):
        load_auth_file(str(tmp_path / "auth.json"))
