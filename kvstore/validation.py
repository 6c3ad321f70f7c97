"""Checks at the API boundary: tokens, KV tensors, `start`, model names.

Each check raises a specific `KVStoreError` subclass whose message names the field, before
anything is stored (so bad input never leaves part of a page behind).
"""
from __future__ import annotations

import operator
import re
import struct
import sys
from typing import Any

import numpy as np
import torch

from kvstore.gpu.dtypes import KV_DTYPES
from kvstore.config import ModelSpec
from kvstore.errors import InvalidKV, InvalidModelName, InvalidRequest, InvalidStart, InvalidTokens
from kvstore.index import TOKEN_BYTES
from kvstore.limits import MAX_SALT_BYTES
from kvstore.page_slice import WHOLE, PageSlice
from kvstore.keys import MAX_TOKEN_ID

_INT32_LE = np.dtype("<i4")
CPU = torch.device("cpu")  # the device of every host fetch: one object, so `on_cpu` is mostly an identity test
_NATIVE_INT32_LE = sys.byteorder == "little" and struct.calcsize("i") == 4  # memoryview.cast("i") reads int32 LE
SMALL_TOKEN_LIST = 64  # token lists up to this long are packed and range-checked without numpy
_INT32_LE_PACKERS = [struct.Struct(f"<{n}i") for n in range(SMALL_TOKEN_LIST + 1)]  # by number of ids
_INT_ONLY = frozenset({int})
MODEL_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:@+/-]{0,199}$")


def check_model_name(model: Any) -> str:
    if not isinstance(model, str) or not MODEL_NAME.match(model):
        raise InvalidModelName(
            f"model: expected 1-200 characters of letters, digits and ._:@+/- starting with a letter "
            f"or digit, got {model!r}", field="model")
    return model


def check_salt(salt: Any) -> str | None:
    """None (no salt) or a non-empty string of at most MAX_SALT_BYTES bytes of UTF-8."""
    if salt is None:
        return None
    try:
        size = len(salt.encode()) if isinstance(salt, str) else -1
    except UnicodeEncodeError:  # a lone surrogate has no UTF-8: it could not name a key
        size = -1
    if not 0 < size <= MAX_SALT_BYTES:
        shown = repr(salt[:40]) if isinstance(salt, str) else type(salt).__name__
        raise InvalidRequest(f"salt: expected a non-empty string of at most {MAX_SALT_BYTES} bytes of UTF-8, "
                             f"got {shown}", field="salt")
    return salt


def token_bytes(tokens: Any, *, max_tokens: int, field: str = "tokens") -> bytes:
    """Token ids (a sequence of ints, or a 1-D integer tensor/array) as int32 LE bytes."""
    if tokens.__class__ is not list:  # a list of ints, the common case, skips these checks
        if isinstance(tokens, (bytes, bytearray, memoryview, str)):
            raise InvalidTokens(f"{field}: expected a list of integer token ids, got {type(tokens).__name__}",
                                field=field)
        if isinstance(tokens, np.ndarray) and tokens.dtype == _INT32_LE and tokens.ndim == 1:
            # The sidecar's tokens: a view of the request body. int32 cannot exceed MAX_TOKEN_ID,
            # so only the sign is left to check (a third of the general path's cost).
            if tokens.size > max_tokens:
                raise InvalidTokens(f"{field}: {tokens.size} tokens exceeds the limit of {max_tokens}", field=field)
            packed = tokens.tobytes()
            if _lowest_id(packed, tokens.size) < 0:
                raise InvalidTokens(f"{field}: token ids must be in [0, {MAX_TOKEN_ID}]", field=field)
            return packed
        if isinstance(tokens, torch.Tensor):
            if tokens.dtype.is_floating_point or tokens.dtype.is_complex or tokens.dtype == torch.bool:
                raise InvalidTokens(f"{field}: expected a 1-D integer tensor, got {tokens.dtype} of shape "
                                    f"{tuple(tokens.shape)}", field=field)
            # Checked by numpy, which reduces every integer type (torch has no min of uint16-64).
            tokens = tokens.detach().cpu().numpy()
        elif hasattr(tokens, "__array_interface__") and not isinstance(tokens, np.ndarray):
            tokens = np.asarray(tokens)
        if isinstance(tokens, np.ndarray):
            if tokens.ndim != 1 or tokens.dtype.kind not in "iu":
                raise InvalidTokens(f"{field}: expected a 1-D integer tensor, got {tokens.dtype} of shape "
                                    f"{tokens.shape}", field=field)
            if tokens.size > max_tokens:
                raise InvalidTokens(f"{field}: {tokens.size} tokens exceeds the limit of {max_tokens}", field=field)
            if tokens.size and (int(tokens.min()) < 0 or int(tokens.max()) > MAX_TOKEN_ID):
                raise InvalidTokens(f"{field}: token ids must be in [0, {MAX_TOKEN_ID}]", field=field)
            return np.ascontiguousarray(tokens, dtype=np.int32).tobytes()
    try:
        n = len(tokens)
    except TypeError:
        raise InvalidTokens(f"{field}: expected a list of integer token ids, got {type(tokens).__name__}",
                            field=field) from None
    if n > max_tokens:
        raise InvalidTokens(f"{field}: {n} tokens exceeds the limit of {max_tokens}", field=field)
    # One C-speed pass over the ids' types: a set for a few, a count past them (no hashing).
    if not (set(map(type, tokens)) <= _INT_ONLY if n <= SMALL_TOKEN_LIST else list(map(type, tokens)).count(int) == n):
        tokens = _indexes(tokens, set(map(type, tokens)), field)  # numpy or torch integer scalars, say
    # A struct packs ids for a third to a half of what array('i') costs (which parses each id
    # with a format): a few ids by a prebuilt one, more by one built for their number (a
    # fraction of their packing). A few ids at hand as ints: the builtin min() of them.
    try:
        packed = (_INT32_LE_PACKERS[n] if n <= SMALL_TOKEN_LIST else struct.Struct(f"<{n}i")).pack(*tokens)
    except struct.error:
        raise InvalidTokens(f"{field}: token ids must be in [0, {MAX_TOKEN_ID}]", field=field) from None
    lowest = min(tokens) if 0 < n <= SMALL_TOKEN_LIST else _lowest_id(packed, n)
    if lowest < 0:
        raise InvalidTokens(f"{field}: token ids must be in [0, {MAX_TOKEN_ID}], got {lowest}", field=field)
    return packed


def _lowest_id(packed: bytes, n: int) -> int:
    """The smallest of the `n` int32 LE ids in `packed` (0 for none). A few: the builtin min()
    over the bytes viewed as native ints (little-endian hosts), which costs less than numpy's
    reduction and its fixed cost per call; more: numpy's."""
    if not n:
        return 0
    if n <= SMALL_TOKEN_LIST and _NATIVE_INT32_LE:
        return min(memoryview(packed).cast("i"))
    return int(np.frombuffer(packed, dtype=_INT32_LE).min())


def _indexes(tokens: Any, types: set[type], field: str) -> list[int]:
    """Token ids that are not all Python ints as ints: anything `operator.index` takes (numpy and
    torch integer scalars, one-element integer tensors) but bools (True is not a token id)."""
    refused = InvalidTokens(f"{field}: every token id must be an integer", field=field)
    if any(issubclass(t, (bool, np.bool_)) for t in types):
        raise refused
    try:
        ids = list(map(operator.index, tokens))  # floats, strings and None raise TypeError
    except TypeError:
        raise refused from None
    if any(issubclass(t, torch.Tensor) for t in types) and any(
            isinstance(tok, torch.Tensor) and tok.dtype == torch.bool for tok in tokens):
        raise refused  # operator.index takes a bool tensor as 0 or 1
    return ids


def check_start(start: Any, num_tokens: int) -> int:
    if isinstance(start, bool) or not isinstance(start, int):
        raise InvalidStart(f"start: expected an integer, got {start!r}", field="start")
    if start < 0 or start > num_tokens:
        raise InvalidStart(f"start: must be in [0, {num_tokens}] (the number of tokens), got {start}", field="start")
    return start


def check_kv(kv: Any, spec: ModelSpec, num_tokens: int, part: PageSlice = WHOLE) -> torch.Tensor:
    """`kv` as a torch tensor of shape (L, 2, num_tokens, H, D) in the spec's dtype (of `part`'s
    layers and heads only, for a part)."""
    if not isinstance(kv, torch.Tensor):
        if hasattr(kv, "__array_interface__"):
            try:
                kv = torch.from_numpy(kv)
            except TypeError as exc:
                raise InvalidKV(f"kv: unsupported array: {exc}", field="kv") from None
        else:
            raise InvalidKV(f"kv: expected a torch tensor or numpy array, got {type(kv).__name__}", field="kv")
    if kv.dtype is not KV_DTYPES[spec.dtype]:  # torch dtypes are singletons
        raise InvalidKV(f"kv: dtype must be {spec.dtype} (the model's), got {str(kv.dtype).removeprefix('torch.')}",
                        field="kv")
    want = part.kv_shape(spec, num_tokens)
    if kv.shape != want:  # a torch.Size is a tuple
        what = "" if part.whole else f" (layers {part.layer_range(spec)}, heads {part.head_range(spec)})"
        raise InvalidKV(f"kv: shape must be (L, 2, T, H, D) = {want} for {num_tokens} tokens{what}, "
                        f"got {tuple(kv.shape)}", field="kv")
    return kv


def check_device(device: Any) -> torch.device:
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError):
        raise InvalidRequest(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}", field="device") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise InvalidRequest("device: 'cuda' asked for, but no CUDA device is available", field="device")
    if dev.type not in ("cpu", "cuda"):
        raise InvalidRequest(f"device: expected 'cpu' or 'cuda[:N]', got {device!r}", field="device")
    return dev


def on_cpu(dev: torch.device) -> bool:
    """`dev.type == "cpu"`, tested as `dev is CPU` first: torch.device.type builds a new string
    on every read, and the store passes its one CPU device object."""
    return dev is CPU or dev.type == "cpu"


def check_into(into: Any, dev: torch.device) -> torch.Tensor | None:
    """`into` of a fetch: None, or a flat, contiguous uint8 tensor on the answer's device (CPU)."""
    if into is None:
        return None
    if not (isinstance(into, torch.Tensor) and into.dtype == torch.uint8 and into.dim() == 1 and into.is_contiguous()):
        raise InvalidRequest(f"into: expected a flat contiguous uint8 tensor, got {_describe(into)}", field="into")
    if not (into.is_cpu and on_cpu(dev)):
        raise InvalidRequest(f"into: must be on the answer's device, and that must be the CPU (into on {into.device}, "
                             f"device={dev})", field="into")
    return into


def _describe(value: Any) -> str:
    if isinstance(value, torch.Tensor):
        return f"a {value.dtype} tensor of shape {tuple(value.shape)}{'' if value.is_contiguous() else ' (strided)'}"
    return type(value).__name__


MAX_CHUNKS = 4096  # per blend: each is a lookup of its own; more is a request to refuse, not to serve slowly


def check_chunks(chunks: Any, *, max_tokens: int) -> list[bytes]:
    """CacheBlend chunks: a non-empty list of non-empty token lists -> int32 LE bytes per chunk."""
    if isinstance(chunks, (str, bytes, bytearray)) or not isinstance(chunks, (list, tuple)):
        raise InvalidTokens(f"chunks: expected a list of token lists, got {type(chunks).__name__}", field="chunks")
    if not 1 <= len(chunks) <= MAX_CHUNKS:
        raise InvalidTokens(f"chunks: must hold 1 to {MAX_CHUNKS} chunks, got {len(chunks)}", field="chunks")
    out = [token_bytes(c, max_tokens=max_tokens, field=f"chunks[{i}]") for i, c in enumerate(chunks)]
    for i, tb in enumerate(out):
        if not tb:
            raise InvalidTokens(f"chunks[{i}]: a chunk must hold at least one token", field="chunks")
    if sum(map(len, out)) // TOKEN_BYTES > max_tokens:
        raise InvalidTokens(f"chunks: more than {max_tokens} tokens in all", field="chunks")
    return out


def check_start_pos(start_pos: Any) -> int:
    if isinstance(start_pos, bool) or not isinstance(start_pos, int) or not 0 <= start_pos <= MAX_TOKEN_ID:
        raise InvalidStart(f"start_pos: expected an integer in [0, {MAX_TOKEN_ID}], got {start_pos!r}",
                           field="start_pos")
    return start_pos
