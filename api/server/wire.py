"""The sidecar's wire format: decode and validate request bodies, encode responses.

Requests are msgpack maps (`application/msgpack`); JSON is accepted where the request says
`application/json` (then `kv` is base64). `tokens` is an array of ints or a `bin` of
little-endian int32; `kv` is a `bin` of the (L, 2, T, H, D) tensor, viewed in place, never
copied here. Type errors name their field; range checks that need the model spec (kv length)
happen in `kv_tensor`, the rest of the semantics (token ranges against the model, page
bookkeeping) is the store's.

Responses are msgpack, or JSON when the request asked for it (Accept, else Content-Type:
`answer_in_json`). Nothing here knows a server: the data plane (api/server/fast_path.py) writes the
data routes' answers, a fetch's as a msgpack prefix and then the tensor's own bytes; aiohttp's
admin handlers answer through api/admin/wire.py.
"""
from __future__ import annotations

import base64
import binascii
import functools
import json
import reprlib
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kvstore.api.framing import FramingError, unpack_map
from kvstore.api.nesting import json_too_deep
from kvstore.api.protocol import JSON, MSGPACK, SHM_REGION_FIELDS, SHM_REGISTRATION_FIELDS
from kvstore.api.server.shared_memory import Registration
from kvstore.gpu.dtypes import KV_DTYPE_NAMES, KV_DTYPES, NUMPY_KV_DTYPES
from kvstore.config import ModelSpec
from kvstore.errors import InvalidKV, InvalidModelName, InvalidModelSpec, InvalidRequest, InvalidStart, InvalidTokens
from kvstore.keys import MAX_TOKEN_ID
from kvstore.page_slice import WHOLE, PageSlice

MSGPACK_TYPES = frozenset({MSGPACK, "application/x-msgpack", "application/vnd.msgpack"})
# A body without a Content-Type (or a generic one) is taken as msgpack: that is the contract.
DEFAULT_TYPES = frozenset({"", "application/octet-stream"})
# The deepest any request nests, its own map counted: blend's chunks ([[token, ...], ...]) and a
# model spec's rope_scaling ({"long_factor": [...]}) reach 3. Deeper bodies are refused before
# they are decoded (api/nesting.py): decoders recurse once per level.
MAX_BODY_DEPTH = 3
_TOKEN_DTYPE = np.dtype("<i4")  # made once: numpy parses a dtype string on every call


# The data routes' requests are plain (slotted) dataclasses, not frozen ones: a frozen
# dataclass's __init__ sets each field through object.__setattr__, three times the cost of a
# plain one's, on every request. Nothing changes a request once it is parsed.
@dataclass(slots=True)
class TokensRequest:
    model: str
    tokens: Any  # list[int] or a 1-D int32 ndarray viewing the body
    start: int = 0
    shm: tuple[int, int] | None = None  # (offset, nbytes) of the connection's shared memory (shared_memory.py)
    salt: str | None = None  # pages under a salt are found under that salt only (checked by the store)
    # A slice of the pages, (start, stop) each (kvstore/page_slice.py): a tensor-parallel rank's
    # KV heads, a pipeline stage's layers. Checked by the store against the model's spec.
    heads: Any = None
    layers: Any = None


@dataclass(slots=True)
class StoreRequest(TokensRequest):
    kv: memoryview = memoryview(b"")  # (L, 2, T, H, D) bytes for tokens[start:]
    dtype: str | None = None


@dataclass(frozen=True)
class BlendRequest:
    model: str
    chunks: list[Any]  # per chunk: list[int] or a 1-D int32 ndarray viewing the body
    start_pos: int = 0
    salt: str | None = None


# ---- reading ---------------------------------------------------------------------------------

def decode_msgpack(body: bytearray | memoryview) -> dict[str, Any]:
    try:
        return unpack_map(body, MAX_BODY_DEPTH)
    except FramingError as exc:
        raise InvalidRequest(f"body: {exc}", field="body") from None


def decode_json(body: bytearray | memoryview) -> dict[str, Any]:
    try:  # JSON between systems is UTF-8 (RFC 8259); a leading BOM is tolerated, as json.loads does
        text = str(body, "utf-8-sig")
    except UnicodeDecodeError as exc:
        raise InvalidRequest(f"body: JSON must be UTF-8: {exc}", field="body") from None
    if json_too_deep(body, text, MAX_BODY_DEPTH):
        raise InvalidRequest(f"body: nested deeper than {MAX_BODY_DEPTH} levels; no request field nests that deep",
                             field="body")
    try:
        obj = json.loads(text)
    except ValueError as exc:
        raise InvalidRequest(f"body: malformed JSON: {exc}", field="body") from None
    if not isinstance(obj, dict):
        raise InvalidRequest("body: expected a JSON object", field="body")
    if isinstance(obj.get("kv"), str):  # JSON has no bytes: kv travels as base64
        try:
            obj["kv"] = memoryview(bytearray(base64.b64decode(obj["kv"], validate=True)))
        except (binascii.Error, ValueError):
            raise InvalidKV("kv: expected base64 in a JSON body", field="kv") from None
    return obj


# ---- fields ----------------------------------------------------------------------------------

def check_fields(body: dict[str, Any], required: tuple[str, ...], optional: tuple[str, ...] = ()) -> None:
    for name in required:
        if name not in body:
            raise _error_for(name)(f"{name}: required", field=name)
    allowed = _allowed(required, optional)
    if not allowed.issuperset(body):
        name = next(name for name in body if name not in allowed)
        raise InvalidRequest(f"{name}: unknown field (expected {', '.join(sorted(allowed))})", field=name)


@functools.lru_cache(maxsize=None)  # a handful of routes' field lists: the set is made once per route
def _allowed(required: tuple[str, ...], optional: tuple[str, ...]) -> frozenset[str]:
    return frozenset(required) | frozenset(optional)


def model_name(value: Any, field: str = "model") -> str:
    if not isinstance(value, str) or not value:
        raise InvalidModelName(f"{field}: expected a non-empty string, got {_show(value)}", field=field)
    return value


def tokens(value: Any) -> Any:
    """An int array or int32 LE bin -> list[int] or a 1-D int32 ndarray (a view, no copy).

    A bin's ids are not range-checked here: every store call that takes tokens checks an int32
    array's sign itself (kvstore/validation.py `token_bytes`, InvalidTokens naming `tokens`), and
    checking twice cost a numpy reduction per request."""
    if isinstance(value, memoryview):
        if value.nbytes % 4:
            raise InvalidTokens(f"tokens: a bin of int32 needs a multiple of 4 bytes, got {value.nbytes}",
                                field="tokens")
        return np.frombuffer(value, dtype=_TOKEN_DTYPE)
    if not isinstance(value, list):
        raise InvalidTokens(f"tokens: expected an array of ints or a bin of int32, got {_show(value)}", field="tokens")
    for i, tok in enumerate(value):
        if isinstance(tok, bool) or not isinstance(tok, int):
            raise InvalidTokens(f"tokens[{i}]: expected an int, got {_show(tok)}", field="tokens")
        if not 0 <= tok <= MAX_TOKEN_ID:
            raise InvalidTokens(f"tokens[{i}]: must be in [0, {MAX_TOKEN_ID}], got {tok}", field="tokens")
    return value


def start(value: Any, num_tokens: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidStart(f"start: expected an int, got {_show(value)}", field="start")
    if not 0 <= value <= num_tokens:
        raise InvalidStart(f"start: must be in [0, {num_tokens}] (the number of tokens), got {value}", field="start")
    return value


def lookup_request(body: dict[str, Any]) -> TokensRequest:
    check_fields(body, ("model", "tokens"), ("salt",))
    return TokensRequest(model_name(body["model"]), tokens(body["tokens"]), salt=body.get("salt"))


def fetch_request(body: dict[str, Any]) -> TokensRequest:
    check_fields(body, ("model", "tokens"), ("start", "shm", "salt", "heads", "layers"))
    toks = tokens(body["tokens"])
    return TokensRequest(model_name(body["model"]), toks, start(body.get("start", 0), len(toks)),
                         shm_region(body.get("shm")), body.get("salt"), body.get("heads"), body.get("layers"))


def store_request(body: dict[str, Any]) -> StoreRequest:
    return _store_request(body, ("kv", "shm", "start", "dtype", "salt", "heads", "layers"))


def _store_request(body: dict[str, Any], optional: tuple[str, ...]) -> StoreRequest:
    check_fields(body, ("model", "tokens"), optional)
    toks = tokens(body["tokens"])
    region = shm_region(body.get("shm"))
    if ("kv" in body) == (region is not None):
        raise InvalidKV("kv: give exactly one of kv (the bytes) or shm (where they are in shared memory)", field="kv")
    kv = body.get("kv", memoryview(b""))
    if not isinstance(kv, memoryview):
        raise InvalidKV(f"kv: expected a bin of the (L, 2, T, H, D) tensor, got {_show(kv)}", field="kv")
    dtype = body.get("dtype")
    if dtype is not None and (not isinstance(dtype, str) or dtype not in KV_DTYPES):  # a list would not even hash
        raise InvalidKV(f"dtype: must be one of {', '.join(KV_DTYPES)}, got {_show(dtype)}", field="dtype")
    return StoreRequest(model_name(body["model"]), toks, start(body.get("start", 0), len(toks)), region,
                        body.get("salt"), body.get("heads"), body.get("layers"), kv, dtype)


def chunk_store_request(body: dict[str, Any]) -> StoreRequest:
    return _store_request(body, ("kv", "shm", "dtype", "salt"))


def shm_region(value: Any) -> tuple[int, int] | None:
    """`shm` of a fetch or store: {"offset": int, "nbytes": int} in the connection's shared memory."""
    if value is None:
        return None
    # Two fields, both present: exactly offset and nbytes (no set built per request).
    if not isinstance(value, dict) or len(value) != 2 or "offset" not in value or "nbytes" not in value:
        raise InvalidRequest(f"shm: expected a map with exactly offset and nbytes, got {_show(value)}", field="shm")
    for name in SHM_REGION_FIELDS:
        v = value[name]
        if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << 40:
            raise InvalidRequest(f"shm.{name}: expected an int in [0, 2**40), got {_show(v)}", field="shm")
    return value["offset"], value["nbytes"]


def shm_registration(body: dict[str, Any]) -> Registration:
    check_fields(body, SHM_REGISTRATION_FIELDS)
    try:
        return Registration(body["pid"], body["fd"], body["nbytes"], body["secret"])
    except (ValueError, TypeError) as exc:
        field = str(exc).split(":", 1)[0] if ":" in str(exc) else "shm"
        raise InvalidRequest(f"{exc}", field=field) from None


def blend_request(body: dict[str, Any]) -> BlendRequest:
    check_fields(body, ("model", "chunks"), ("start_pos", "salt"))
    chunks = body["chunks"]
    if not isinstance(chunks, list) or not chunks:
        raise InvalidTokens(f"chunks: expected a non-empty array of token arrays, got {_show(chunks)}", field="chunks")
    parsed = []
    for i, chunk in enumerate(chunks):
        try:
            # Nested bins arrive as bytes (only top-level ones are views of the body).
            parsed.append(tokens(memoryview(bytearray(chunk)) if isinstance(chunk, bytes) else chunk))
        except InvalidTokens as exc:
            raise InvalidTokens(f"chunks[{i}]: {exc.message}", field="chunks") from None
    start_pos = body.get("start_pos", 0)
    if isinstance(start_pos, bool) or not isinstance(start_pos, int) or not 0 <= start_pos <= MAX_TOKEN_ID:
        raise InvalidStart(f"start_pos: expected an int in [0, {MAX_TOKEN_ID}], got {_show(start_pos)}",
                           field="start_pos")
    return BlendRequest(model_name(body["model"]), parsed, start_pos, body.get("salt"))


def model_spec(body: dict[str, Any]) -> ModelSpec:
    try:
        return ModelSpec.from_dict(body)
    except (ValueError, TypeError) as exc:
        field = str(exc).split(":", 1)[0] if ":" in str(exc) else None
        raise InvalidModelSpec(str(exc), field=field) from None


def kv_tensor(kv: memoryview, spec: ModelSpec, num_tokens: int, dtype: str | None = None,
              part: PageSlice = WHOLE) -> torch.Tensor:
    """View the kv bytes as the (L, 2, T, H, D) tensor of `spec` (of `part`'s layers and heads
    only, for a part), without copying."""
    if dtype is not None and dtype != spec.dtype:
        raise InvalidKV(f"kv: dtype {dtype} does not match the model's {spec.dtype}", field="kv")
    per_token = part.bytes_per_token(spec)
    expected = num_tokens * per_token
    if kv.nbytes != expected:
        raise InvalidKV(f"kv: expected {num_tokens} tokens x {per_token} bytes per token = "
                        f"{expected} bytes, got {kv.nbytes}", field="kv")
    shape = part.kv_shape(spec, num_tokens)
    if not expected:
        return torch.empty(shape, dtype=KV_DTYPES[spec.dtype])
    np_dtype = NUMPY_KV_DTYPES.get(spec.dtype)
    if np_dtype is not None:  # viewed by numpy: torch.frombuffer and its view cost twice as much
        return torch.from_numpy(np.frombuffer(kv, dtype=np_dtype).reshape(shape))
    return torch.frombuffer(kv, dtype=KV_DTYPES[spec.dtype]).view(shape)  # (L, 2, T, H, D)


def _error_for(name: str) -> type[InvalidRequest]:
    errors = {"tokens": InvalidTokens, "kv": InvalidKV, "start": InvalidStart, "model": InvalidModelName}
    return errors.get(name, InvalidRequest)


_SHOWN = reprlib.Repr()  # bounded in depth and length: a value in an error message never recurses far
_SHOWN.maxlevel, _SHOWN.maxstring, _SHOWN.maxother, _SHOWN.maxlist, _SHOWN.maxdict = 2, 40, 40, 6, 4


def _show(value: Any) -> str:
    if isinstance(value, memoryview):
        return f"a bin of {value.nbytes} bytes"
    text = _SHOWN.repr(value)
    return f"{type(value).__name__} {text[:40]}{'...' if len(text) > 40 else ''}"


# ---- writing ---------------------------------------------------------------------------------

def answer_in_json(accept: str, content_type: str, method: str) -> bool:
    """Whether an answer is JSON: the Accept header decides, else the request's Content-Type
    (a bodiless GET or DELETE with no Accept gets JSON, as a browser or curl would want)."""
    if "msgpack" in accept:
        return False
    if JSON in accept:
        return True
    return content_type == JSON or method in ("GET", "DELETE") and not accept


def kv_payload(kv: torch.Tensor | None) -> tuple[dict[str, Any], Any]:
    """(fields, flat uint8 array of the kv bytes) of a result tensor: fields name its dtype and
    shape; no kv is `kv: None` and no bytes. Call it off the loop: a tensor that is not
    contiguous is copied here."""
    if kv is None:
        return {"kv": None}, None
    if kv.dtype != torch.bfloat16 and kv.is_contiguous():  # viewed by numpy: several times cheaper than torch's views
        raw = kv.numpy().reshape(-1).view(np.uint8)  # flat bytes of (L, 2, T, H, D)
    else:  # numpy has no bfloat16; a strided kv is copied
        raw = kv.contiguous().view(-1).view(torch.uint8).numpy()
    return {"dtype": KV_DTYPE_NAMES[kv.dtype], "shape": list(kv.shape)}, raw


def fetch_answer(matched_tokens: int, kv: torch.Tensor | None, shm: tuple[int, int] | None,
                 into: Any) -> tuple[dict[str, Any], Any]:
    """A fetch's answer as (fields, kv bytes or None): `shm` instead of `kv` when the store wrote
    the kv into the client's region `into` (the bytes are already where the client reads them;
    nothing else to view or convert). Otherwise as `kv_payload`: call it off the loop then."""
    if into is not None and kv is not None and (nbytes := kv.nbytes) and kv.data_ptr() == into.data_ptr() \
            and kv.is_contiguous():
        assert shm is not None
        return {"matched_tokens": matched_tokens, "dtype": KV_DTYPE_NAMES[kv.dtype], "shape": list(kv.shape),
                "shm": {"offset": shm[0], "nbytes": nbytes}}, None
    fields, raw = kv_payload(kv)
    return {"matched_tokens": matched_tokens, **fields}, raw
