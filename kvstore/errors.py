"""The error hierarchy raised at kvstore's boundaries.

Every error a caller can provoke is a `KVStoreError` subclass with a stable `code` (the
`error.code` of an HTTP error body) and the HTTP `status` the sidecar answers with. Config
mistakes are `ValueError`s raised at construction instead: they are programming errors, not
requests. A miss is never an error.
"""
from __future__ import annotations


class KVStoreError(Exception):
    """Base class: `code` names the error on the wire, `status` is its HTTP status."""

    code = "internal"
    status = 500

    def __init__(self, message: str, *, field: str | None = None):
        super().__init__(message)
        self.message = message
        self.field = field


class InvalidRequest(KVStoreError):
    """The request is malformed: a field is missing, of the wrong type or out of range."""

    code = "invalid_request"
    status = 400


class InvalidTokens(InvalidRequest):
    code = "invalid_tokens"


class InvalidKV(InvalidRequest):
    """`kv` has the wrong shape, dtype or byte length for the tokens it covers."""

    code = "invalid_kv"


class InvalidStart(InvalidRequest):
    code = "invalid_start"


class InvalidModelName(InvalidRequest):
    code = "invalid_model_name"


class InvalidModelSpec(InvalidRequest):
    code = "invalid_model_spec"


class Unauthorized(KVStoreError):
    code = "unauthorized"
    status = 401


class SharedMemoryRefused(KVStoreError):
    """The sidecar will not use the shared memory a client named (disabled, another host or
    user, not a sealed memfd, wrong secret, or none registered on this connection)."""

    code = "shared_memory_refused"
    status = 403


class ModelNotFound(KVStoreError):
    code = "model_not_found"
    status = 404


class ModelConflict(KVStoreError):
    """The model name is registered with a different spec."""

    code = "model_conflict"
    status = 409


class PartConflict(KVStoreError):
    """A part of a page (`heads` / `layers`) overlaps a different part another writer already
    wrote: two writers split the page's KV differently (kvstore/page_parts.py)."""

    code = "part_conflict"
    status = 409


class RequestTimeout(KVStoreError):
    """The request body did not arrive within the server's body timeout (a slow or stalled client)."""

    code = "request_timeout"
    status = 408


class PayloadTooLarge(KVStoreError):
    code = "payload_too_large"
    status = 413


class UnsupportedMediaType(KVStoreError):
    code = "unsupported_media_type"
    status = 415


class Unsupported(KVStoreError):
    """The request is well formed but asks for something this store cannot do exactly."""

    code = "unsupported"
    status = 422


class InsufficientStorage(KVStoreError):
    """No tier can take the pages, even after eviction (everything left is pinned)."""

    code = "insufficient_storage"
    status = 507


class BackendUnavailable(KVStoreError):
    """A remote store (the sidecar, Redis) could not be reached in time."""

    code = "backend_unavailable"
    status = 503


class StoreBusy(Exception):
    """Raised only inside `unless_busy` (api/server/loop_store.py): the call would have to wait for another thread
    (a store met pages another store is still writing). Nothing was done; the caller runs the
    call again where it may wait (the sidecar: on a pool thread). Not a `KVStoreError`: it never
    reaches a client."""


ERRORS_BY_CODE: dict[str, type[KVStoreError]] = {}


def _register(cls: type[KVStoreError]) -> None:
    ERRORS_BY_CODE[cls.code] = cls
    for sub in cls.__subclasses__():
        _register(sub)


_register(KVStoreError)
