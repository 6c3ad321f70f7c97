"""Bearer tokens map to tenants; tenants never see each other's models or pages."""
from __future__ import annotations

import json

import pytest
from aiohttp.test_utils import TestClient, TestServer
from api_helpers import MSGPACK, call, kv_bin, random_kv

from api.app import create_app
from api.auth import find_tenant, load_auth_file
from api.config import ServerConfig
from kvstore import ModelSpec

TOKENS = {"secret-alice-0123456789": "alice", "secret-bob-0123456789": "bob"}


@pytest.fixture
async def authed(store, tmp_path):
    path = tmp_path / "auth.json"
    path.write_text(json.dumps(TOKENS))
    async with TestClient(TestServer(create_app(store, ServerConfig(auth_file=str(path))))) as client:
        yield client


def as_(tenant_token: str) -> dict[str, str]:
    return {**MSGPACK, "Authorization": f"Bearer {tenant_token}"}


@pytest.mark.parametrize("authorization", [None, "", "Bearer", "Bearer wrong", "Basic c2VjcmV0", "secret-alice-0123456789"])
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
    assert (await call(authed, "POST", "/v1/store", {"model": "m", "tokens": [1, 2, 3, 4], "kv": kv_bin(kv)}, headers=alice))[0] == 200
    status, body = await call(authed, "POST", "/v1/lookup", {"model": "m", "tokens": [1, 2, 3, 4]}, headers=bob)
    assert status == 404 and body["error"]["code"] == "model_not_found"
    # Bob registering the same name gets his own, empty namespace.
    assert (await call(authed, "PUT", "/v1/models/m", spec.to_dict(), headers=bob))[0] == 201
    assert (await call(authed, "POST", "/v1/lookup", {"model": "m", "tokens": [1, 2, 3, 4]}, headers=bob))[1]["matched_tokens"] == 0
    assert (await call(authed, "POST", "/v1/lookup", {"model": "m", "tokens": [1, 2, 3, 4]}, headers=alice))[1]["matched_tokens"] == 4


def test_find_tenant_and_bad_auth_files(tmp_path):
    table = {b"tok-a": "a", b"tok-b": "b"}
    assert find_tenant(table, b"tok-b") == "b" and find_tenant(table, b"tok-") is None
    for text in ("[]", "{}", '{"tok": ""}', "not json"):
        (tmp_path / "auth.json").write_text(text)
        with pytest.raises(ValueError, match="auth_file"):
            load_auth_file(str(tmp_path / "auth.json"))
    with pytest.raises(ValueError, match="auth_file: cannot read"):
        load_auth_file(str(tmp_path / "missing.json"))
