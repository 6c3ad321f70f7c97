"""The error hierarchy raised at kvstore's boundaries.

Every error a caller can provoke is a `KVStoreError` subclass with a stable `code` (the
`error.code` of an HTTP error body) and the HTTP `status` the sidecar answers with. Config
mistakes are `ValueError`s raised at construction instead: they are programming errors, not
requests. A miss is never an error.
"""
from __future__ import annotations


ERRORS_BY_CODE: dict[str, type["KVStoreError"]] = {}


class KVStoreError(Exception):
    """Base class: `code` names the error on the wire, `status` is its HTTP status. A subclass
    names both as class keywords (a status it leaves out is its parent's), and is registered
    under its code, so a client raises the same class the server did."""

    code = "internal"
    status = 500

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field

    def __init_subclass__(cls, *, code: str, status: int | None = None, **kwargs: object) -> None:
        super().__init_subclass__(**kwargs)
        if code in ERRORS_BY_CODE:
            raise TypeError(f"{cls.__name__}: error code {code!r} is {ERRORS_BY_CODE[code].__name__}'s already")
        cls.code = code
        if status is not None:
            cls.status = status
        ERRORS_BY_CODE[code] = cls


ERRORS_BY_CODE[KVStoreError.code] = KVStoreError


class InvalidRequest(KVStoreError, code="invalid_request", status=400):
    """The request is malformed: a field is missing, of the wrong type or out of range."""


class InvalidTokens(InvalidRequest, code="invalid_tokens"):
    """Token ids that are not a list (or 1-D integer tensor) of ids in range, or too many of them."""


class InvalidKV(InvalidRequest, code="invalid_kv"):
    """`kv` has the wrong shape, dtype or byte length for the tokens it covers."""


class InvalidStart(InvalidRequest, code="invalid_start"):
    """`start` or `start_pos` is not an integer in its range."""


class InvalidModelName(InvalidRequest, code="invalid_model_name"):
    """The model name is not 1-200 letters, digits and ._:@+/- starting with a letter or digit."""


class InvalidModelSpec(InvalidRequest, code="invalid_model_spec"):
    """The model's spec (layers, heads, head size, dtype, page size, RoPE) is incomplete or out of range."""


class Unauthorized(KVStoreError, code="unauthorized", status=401):
    """No bearer token, or one the sidecar does not know."""


class SharedMemoryRefused(KVStoreError, code="shared_memory_refused", status=403):
    """The sidecar will not use the shared memory a client named (disabled, another host or
    user, not a sealed memfd, wrong secret, or none registered on this connection)."""


class ModelNotFound(KVStoreError, code="model_not_found", status=404):
    """No model is registered under that name (for this tenant)."""


class ModelConflict(KVStoreError, code="model_conflict", status=409):
    """The model name is registered with a different spec."""


class PartConflict(KVStoreError, code="part_conflict", status=409):
    """A part of a page (`heads` / `layers`) overlaps a different part another writer already
    wrote: two writers split the page's KV differently (kvstore/page_parts.py)."""


class RequestTimeout(KVStoreError, code="request_timeout", status=408):
    """The request body did not arrive within the server's body timeout (a slow or stalled client)."""


class PayloadTooLarge(KVStoreError, code="payload_too_large", status=413):
    """The request body, or the KV an answer would carry, is over its limit."""


class UnsupportedMediaType(KVStoreError, code="unsupported_media_type", status=415):
    """The body is neither msgpack nor JSON."""


class Unsupported(KVStoreError, code="unsupported", status=422):
    """The request is well formed but asks for something this store cannot do exactly."""


class InsufficientStorage(KVStoreError, code="insufficient_storage", status=507):
    """No tier can take the pages, even after eviction (everything left is pinned)."""


class BackendUnavailable(KVStoreError, code="backend_unavailable", status=503):
    """A remote store (the sidecar, Redis) could not be reached in time."""


class StoreBusy(Exception):
    """Raised only inside `unless_busy` (api/server/loop_store.py): the call would have to wait for another thread
    (a store met pages another store is still writing). Nothing was done; the caller runs the
    call again where it may wait (the sidecar: on a pool thread). Not a `KVStoreError`: it never
    reaches a client."""
