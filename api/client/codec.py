"""What the clients put on the wire and how they read answers, transport aside.

Used by `KVStoreClient` (api/client/http1.py; `AsyncKVStoreClient` runs it on threads): tokens go as a
`bin` of little-endian int32, `kv` as the tensor's own bytes after a hand-built msgpack prefix
(the caller sends the parts back to back, never joined), and a response's `kv` is viewed in
place in the buffer it was read into. Error bodies become the `KVStoreError` subclass named by
their code, so a caller catches the same exceptions as with the in-process store.
"""
from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

import msgpack
import numpy as np
import torch

from kvstore.api.protocol import JSON, MSGPACK, SHM_REGION_FIELDS
from kvstore.api.framing import FramingError, pack_map_prefix, unpack_map
from kvstore.gpu.dtypes import KV_DTYPE_NAMES, KV_DTYPES, NUMPY_KV_DTYPES
from kvstore.config import DTYPE_BYTES, ModelSpec
from kvstore.errors import ERRORS_BY_CODE, InvalidKV, InvalidTokens, KVStoreError
from kvstore.keys import MAX_TOKEN_ID
from kvstore.results import BlendResult, FetchResult, LookupResult, StoreResult
from kvstore.limits import MAX_TOKENS
from kvstore.validation import SMALL_TOKEN_LIST, check_salt, token_bytes

HEADERS = {"Content-Type": MSGPACK, "Accept": MSGPACK}

Parts = list[Any]  # bytes-like parts, sent back to back


def tokens_bin(tokens: Any) -> bytes | memoryview:
    """Token ids -> little-endian int32 bytes: a 1-D integer tensor/array by numpy (no copy when
    it is int32 already), any other sequence as the in-process store takes it (kvstore/
    validation.py: ints, or integer scalars of numpy or torch; never bools or floats)."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.detach().cpu().numpy()
    if not isinstance(tokens, np.ndarray):
        return token_bytes(tokens, max_tokens=MAX_TOKENS)
    if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
        raise InvalidTokens(f"tokens: expected a 1-D sequence of ints, got {tokens.dtype} of shape {tokens.shape}",
                            field="tokens")
    value_bits = tokens.dtype.itemsize * 8 - (tokens.dtype.kind == "i")  # int32: 31, uint32: 32
    if tokens.size <= SMALL_TOKEN_LIST:  # numpy's reductions cost more than boxing a few ids
        ids = tokens.tolist()
        lowest, highest = (min(ids), max(ids)) if ids else (0, 0)
    else:  # int32 and narrower cannot go past the top of the range: one reduction, not two
        lowest = int(tokens.min()) if tokens.size else 0
        highest = int(tokens.max()) if tokens.size and value_bits > 31 else 0
    if lowest < 0 or highest > MAX_TOKEN_ID:
        raise InvalidTokens(f"tokens: ids must be in [0, {MAX_TOKEN_ID}]", field="tokens")
    return np.ascontiguousarray(tokens, dtype="<i4").data.cast("B")


def kv_bytes(kv: Any) -> tuple[memoryview, str]:
    """A (L, 2, T, H, D) tensor or array -> (its C-order bytes, dtype name), no copy if contiguous."""
    if isinstance(kv, np.ndarray):
        kv = torch.from_numpy(kv)
    if not isinstance(kv, torch.Tensor):
        raise InvalidKV(f"kv: expected a torch tensor or numpy array, got {type(kv).__name__}", field="kv")
    if kv.dtype not in KV_DTYPE_NAMES:
        raise InvalidKV(f"kv: dtype must be one of {', '.join(KV_DTYPES)}, got {kv.dtype}", field="kv")
    if kv.dim() != 5:
        raise InvalidKV(f"kv: expected shape (L, 2, T, H, D), got {tuple(kv.shape)}", field="kv")
    dense = kv.detach().cpu().contiguous()
    if dense.dtype is torch.bfloat16:  # numpy has no bfloat16: its bits, as bytes, by torch
        return dense.view(-1).view(torch.uint8).numpy().data, KV_DTYPE_NAMES[kv.dtype]
    # numpy's view of the same memory, cast to bytes: torch's two views cost twice as much.
    array = dense.numpy()
    return array.data.cast("B") if array.size else memoryview(b""), KV_DTYPE_NAMES[kv.dtype]


def small_body(fields: dict[str, Any]) -> bytes:
    return msgpack.packb(fields, use_bin_type=True)


def with_salt(fields: dict[str, Any], salt: str | None) -> dict[str, Any]:
    """`fields` with the request's salt, checked here as the store would (no salt: no field)."""
    if salt is not None:
        fields["salt"] = check_salt(salt)
    return fields


def tokens_body(model: str, tokens: Any, start: int | None = None, shm: tuple[int, int] | None = None,
                salt: str | None = None, part: dict[str, Any] | None = None) -> bytes:
    """`part`: the fields naming a slice of the pages (PageSlice.wire_fields)."""
    fields: dict[str, Any] = with_salt({"model": model, "tokens": tokens_bin(tokens), **(part or {})}, salt)
    if start:
        fields["start"] = start
    if shm is not None:  # (offset, nbytes) of the client's shared memory to answer into
        fields["shm"] = dict(zip(SHM_REGION_FIELDS, shm))
    return small_body(fields)


def store_shm_body(model: str, tokens: Any, dtype: str, start: int, shm: tuple[int, int],
                   salt: str | None = None, part: dict[str, Any] | None = None) -> bytes:
    """A store whose KV is already at `shm` = (offset, nbytes) of the client's shared memory."""
    fields: dict[str, Any] = with_salt({"model": model, "tokens": tokens_bin(tokens), "dtype": dtype,
                                        "shm": dict(zip(SHM_REGION_FIELDS, shm)), **(part or {})}, salt)
    if start:
        fields["start"] = start
    return small_body(fields)


def bytes_per_token(obj: dict[str, Any]) -> int | None:
    """KV bytes per token of a fetch answer's model (from its dtype and shape), None without KV."""
    shape, dtype_bytes = obj.get("shape"), DTYPE_BYTES.get(obj.get("dtype", ""))
    if not shape or dtype_bytes is None or len(shape) != 5 or not shape[2]:
        return None
    return shape[0] * shape[1] * shape[3] * shape[4] * dtype_bytes


def store_parts(model: str, tokens: Any, kv: Any, start: int = 0, salt: str | None = None,
                part: dict[str, Any] | None = None) -> Parts:
    raw, dtype = kv_bytes(kv)
    fields: dict[str, Any] = with_salt({"model": model, "tokens": tokens_bin(tokens), "dtype": dtype,
                                        **(part or {})}, salt)
    if start:
        fields["start"] = start
    return [pack_map_prefix(fields, "kv", raw.nbytes), raw]


def blend_body(model: str, chunks: Any, start_pos: int = 0, salt: str | None = None) -> bytes:
    if isinstance(chunks, (str, bytes)) or not hasattr(chunks, "__len__"):
        raise InvalidTokens(f"chunks: expected a list of token lists, got {type(chunks).__name__}", field="chunks")
    fields: dict[str, Any] = with_salt({"model": model, "chunks": [tokens_bin(c) for c in chunks]}, salt)
    if start_pos:
        fields["start_pos"] = start_pos
    return small_body(fields)


def decode(status: int, content_type: str, body: bytearray | bytes | memoryview) -> Any:
    """The response's object; raises the matching KVStoreError for a 4xx/5xx."""
    try:
        obj: Any = json.loads(bytes(body)) if content_type.startswith(JSON) else unpack_map(body) if len(body) else {}
    except (ValueError, FramingError, RecursionError):  # RecursionError: JSON nested past the interpreter's limit
        obj = None
    if status >= 400:
        error = obj.get("error") if isinstance(obj, dict) else None
        if not isinstance(error, dict):
            raise KVStoreError(f"HTTP {status}: {bytes(body[:200])!r}")
        cls = ERRORS_BY_CODE.get(error.get("code", ""), KVStoreError)
        exc = cls(str(error.get("message", "")))
        exc.status = status  # keep what the server said even for codes this client does not know
        raise exc
    if obj is None:
        raise KVStoreError(f"HTTP {status}: undecodable {content_type or 'untyped'} response body")
    return obj


def spec_result(obj: dict[str, Any]) -> ModelSpec:
    return ModelSpec.from_dict(obj)


def lookup_result(obj: dict[str, Any]) -> LookupResult:
    return LookupResult(matched_tokens=obj["matched_tokens"], tiers=dict(obj.get("tiers") or {}))


def store_result(obj: dict[str, Any]) -> StoreResult:
    return StoreResult(stored_tokens=obj["stored_tokens"], new_pages=obj["new_pages"])


def kv_array(array: np.ndarray, obj: dict[str, Any]) -> np.ndarray:
    """The uint8 `array` of a fetch answer's kv typed and shaped (L, 2, T, H, D) by numpy, where
    numpy has the dtype (not bfloat16: then `array` as it is). One numpy view and no torch call:
    torch's views cost several times numpy's."""
    np_dtype = NUMPY_KV_DTYPES.get(obj["dtype"])
    return array if np_dtype is None else array.view(np_dtype).reshape(obj["shape"])


def fetch_result(obj: dict[str, Any], device: str = "cpu", raw: Any = None) -> FetchResult:
    """`raw`: the answer's KV when it came another way than the body (shared memory: an array,
    `kv_array`'s already)."""
    raw = obj.get("kv") if raw is None else raw
    if raw is None:
        return FetchResult(matched_tokens=obj["matched_tokens"], kv=None)
    # A view of the response buffer (the one copy of the fetch path was the socket read) or of
    # the client's shared memory (api/client/arena.py).
    array = raw if isinstance(raw, np.ndarray) else kv_array(np.frombuffer(raw, dtype=np.uint8), obj)
    kv = torch.from_numpy(array)
    if array.dtype == np.uint8:  # bfloat16: typed by torch
        kv = kv.view(KV_DTYPES[obj["dtype"]]).view(tuple(obj["shape"]))
    return FetchResult(matched_tokens=obj["matched_tokens"], kv=kv if device == "cpu" else kv.to(device))


def blend_result(obj: dict[str, Any], device: str = "cpu") -> BlendResult:
    kv = fetch_result({**obj, "matched_tokens": 0}, device).kv  # (L, 2, T, H, D), a view of the response
    return BlendResult(hits=[bool(h) for h in obj["hits"]], kv=kv,
                       positions=[(int(a), int(b)) for a, b in obj["positions"]])


def model_path(model: str) -> str:
    return "/v1/models/" + quote(model, safe="")


def spec_body(spec: ModelSpec) -> bytes:
    return small_body(spec.to_dict())


def check_tenant(tenant: str | None) -> None:
    if tenant is not None:
        raise ValueError("tenant: the sidecar takes the tenant from the bearer token; pass token= to the client")
