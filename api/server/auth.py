"""Bearer-token auth: `--auth-file` maps tokens to tenants; the tenant joins the namespace.

The file is a JSON object `{"<token>": "<tenant>" | {"tenant": "<tenant>", "max_bytes": "2GiB"}, ...}`;
`max_bytes` caps what the tenant holds in each memory tier (`KVStore.set_tenant_quota`). Errors
name an entry by its position and tenant, never by its token. Every `/v1/*` request must carry
`Authorization: Bearer <token>`; a missing or unknown token is 401. The presented token is
compared against every known token with `hmac.compare_digest` and no early exit, so response
time says nothing about how much of a token was right. Without an auth file there is no
tenant (None) and the server only binds loopback (see server.py). The data plane checks a
request's token as it reads its head (api/server/connection.py); aiohttp's `authenticate` middleware
(api/admin/middleware.py) an admin request's.
"""
from __future__ import annotations

import hmac
import json
from dataclasses import dataclass, field
from pathlib import Path
from kvstore.errors import Unauthorized
from kvstore.sizes import parse_bytes

PROTECTED_PREFIX = "/v1/"


@dataclass(frozen=True)
class AuthFile:
    tokens: dict[bytes, str]  # token -> tenant
    quotas: dict[str, int] = field(default_factory=dict)  # tenant -> max_bytes


def load_auth_file(path: str) -> AuthFile:
    """Tokens -> tenants, and tenants' quotas. Raises ValueError naming the file (and the entry,
    by position: tokens are secrets) on anything malformed."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ValueError(f"auth_file: cannot read {path}: {exc.strerror}") from None
    except ValueError as exc:
        raise ValueError(f"auth_file: {path} is not valid JSON: {exc}") from None
    if not isinstance(data, dict) or not data:
        raise ValueError(f'auth_file: {path} must be a non-empty JSON object {{"<token>": "<tenant>"}}')
    tokens: dict[bytes, str] = {}
    quotas: dict[str, int] = {}
    for i, (token, entry) in enumerate(data.items(), 1):
        where = f"auth_file: {path}: entry {i}"
        max_bytes = None
        if isinstance(entry, dict):
            unknown = set(entry) - {"tenant", "max_bytes"}
            if unknown:
                raise ValueError(f"{where}: unknown keys {sorted(unknown)} (allowed: tenant, max_bytes)")
            tenant, max_bytes = entry.get("tenant"), entry.get("max_bytes")
        else:
            tenant = entry
        if not token or not isinstance(tenant, str) or not tenant:
            raise ValueError(f"{where}: every token needs a non-empty tenant string")
        if max_bytes is not None:
            try:
                max_bytes = parse_bytes(max_bytes, field="max_bytes")
            except ValueError as exc:
                raise ValueError(f"{where} (tenant {tenant!r}): {exc}") from None
            if max_bytes <= 0:
                raise ValueError(f"{where} (tenant {tenant!r}): max_bytes must be > 0")
            if quotas.get(tenant, max_bytes) != max_bytes:
                raise ValueError(f"{where} (tenant {tenant!r}): max_bytes differs from another entry "
                                 "of the same tenant")
            quotas[tenant] = max_bytes
        tokens[token.encode()] = tenant
    return AuthFile(tokens, quotas)


def find_tenant(table: dict[bytes, str], presented: bytes) -> str | None:
    found = None
    for token, tenant in table.items():
        if hmac.compare_digest(token, presented):  # no break: constant work whatever matches
            found = tenant
    return found


def bearer_tenant(table: dict[bytes, str], authorization: str) -> str:
    """The tenant of an `Authorization: Bearer <token>` header; Unauthorized (401) otherwise."""
    scheme, _, token = authorization.partition(" ")
    if scheme.lower() != "bearer" or not token.strip():
        raise Unauthorized("Authorization: expected 'Bearer <token>'", field="Authorization")
    tenant = find_tenant(table, token.strip().encode())
    if tenant is None:
        raise Unauthorized("Authorization: unknown bearer token", field="Authorization")
    return tenant
