"""Bearer-token auth: `--auth-file` maps tokens to tenants; the tenant joins the namespace.

The file is a JSON object `{"<token>": "<tenant>", ...}`. Every `/v1/*` request must carry
`Authorization: Bearer <token>`; a missing or unknown token is 401. The presented token is
compared against every known token with `hmac.compare_digest` and no early exit, so response
time says nothing about how much of a token was right. Without an auth file there is no
tenant (None) and the server only binds loopback (see server.py).
"""
from __future__ import annotations

import hmac
import json
from pathlib import Path
from typing import Awaitable, Callable

from aiohttp import web

from api.context import AUTH, TENANT
from kvstore.errors import Unauthorized

PROTECTED_PREFIX = "/v1/"


def load_auth_file(path: str) -> dict[bytes, str]:
    """Token -> tenant. Raises ValueError naming the file on anything malformed."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"auth_file: cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ValueError(f"auth_file: {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f'auth_file: {path} must be a non-empty JSON object {{"<token>": "<tenant>"}}')
    table: dict[bytes, str] = {}
    for token, tenant in data.items():
        if not token or not isinstance(tenant, str) or not tenant:
            raise ValueError(f"auth_file: {path}: every token needs a non-empty tenant string")
        table[token.encode()] = tenant
    return table


def find_tenant(table: dict[bytes, str], presented: bytes) -> str | None:
    found = None
    for token, tenant in table.items():
        if hmac.compare_digest(token, presented):  # no break: constant work whatever matches
            found = tenant
    return found


@web.middleware
async def authenticate(request: web.Request,
                       handler: Callable[[web.Request], Awaitable[web.StreamResponse]]) -> web.StreamResponse:
    table = request.app[AUTH]
    if table and request.path.startswith(PROTECTED_PREFIX):
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise Unauthorized("Authorization: expected 'Bearer <token>'", field="Authorization")
        tenant = find_tenant(table, token.strip().encode())
        if tenant is None:
            raise Unauthorized("Authorization: unknown bearer token", field="Authorization")
        request[TENANT] = tenant
    return await handler(request)
