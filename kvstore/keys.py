"""Deterministic keys: namespaces, chained prefix keys and position-independent chunk keys.

All keys are blake2b-128 digests from hashlib, so they are the same in every process and after
every restart (no Python `hash()`, no random seed). They are security boundaries between tenants,
hence a collision-resistant hash; the index still compares stored token ids, so even a collision
would be a miss, never wrong KV.

    namespace  = H("ns" | model name | spec fingerprint | tenant)
    key_{-1}   = namespace
    key_i      = H(key_{i-1} | int32-LE tokens of page i)      # full pages and the tail page
    chunk key  = H(namespace | "chunk" | int32-LE tokens)
    salt root  = H(namespace | "salt" | salt)                 # a salted request's key_{-1}

A salt (vLLM's `cache_salt`) splits one tenant's namespace into trees that share no page: a
salted request's chain starts at its salt root instead of the namespace, so its pages' keys
differ from every other salt's and from the unsalted ones, while the pages still belong to the
tenant (quota, model, spec) whose namespace they hang under.
"""
from __future__ import annotations

import hashlib
from array import array
from typing import Sequence

KEY_BYTES = 16
MAX_TOKEN_ID = (1 << 31) - 1  # tokens travel as int32


_blake2b = hashlib.blake2b


def _digest(*parts: bytes) -> bytes:
    # One call over the joined parts.
    return _blake2b(b"".join(parts), digest_size=KEY_BYTES).digest()


def namespace_key(model: str, spec_fingerprint: str, tenant: str | None = None) -> bytes:
    # Length-prefixed fields, so ("ab", "c") and ("a", "bc") never collide.
    fields = [b"kvstore-ns-v1", model.encode(), spec_fingerprint.encode(), (tenant or "").encode()]
    return _digest(*(len(f).to_bytes(4, "little") + f for f in fields))


def tokens_bytes(tokens: Sequence[int]) -> bytes:
    """int32 little-endian bytes of validated token ids."""
    arr = array("i", tokens)
    if arr.itemsize != 4:  # pragma: no cover - every platform we run on has a 4-byte C int
        raise AssertionError("array('i') is not 32-bit here")
    return arr.tobytes()


def page_key(parent_key: bytes, page_tokens: bytes | Sequence[int]) -> bytes:
    """`page_tokens`: int32 LE bytes (what the store holds), or validated token ids."""
    if page_tokens.__class__ is not bytes:
        page_tokens = tokens_bytes(page_tokens)
    return _digest(parent_key, page_tokens)


def prefix_keys(namespace: bytes, tokens: Sequence[int], page_size: int) -> list[bytes]:
    """Chained keys of every page of `tokens` (full pages, then the tail page if any)."""
    keys = []
    parent = namespace
    for start in range(0, len(tokens), page_size):
        parent = page_key(parent, tokens[start:start + page_size])
        keys.append(parent)
    return keys


def chunk_key(namespace: bytes, tokens: Sequence[int]) -> bytes:
    return _digest(namespace, b"chunk", tokens_bytes(tokens))


def salt_root(namespace: bytes, salt: str | None) -> bytes:
    """The root key of `salt`'s pages in `namespace`; the namespace itself for no salt."""
    if salt is None:
        return namespace
    salt_bytes = salt.encode()
    return _digest(namespace, b"salt", len(salt_bytes).to_bytes(4, "little"), salt_bytes)
