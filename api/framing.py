"""Zero-copy msgpack framing of the top-level map of a request or response body.

`msgpack.unpackb` copies every `bin` into a new `bytes`; for a multi-MiB `kv` that copy is a
large share of a request's cost. Here the top-level map is walked by hand: `bin` values come
back as memoryview slices of the body (no copy) and every other value is unpacked by msgpack
from its own slice. On the way out, `pack_map_prefix` writes the map header and the small
fields, ending with a `bin` header, so the caller sends the raw tensor bytes right after it.

This module knows msgpack only: it does not know which fields a route expects (see wire.py).
"""
from __future__ import annotations

import reprlib
import struct
from typing import Any, Mapping

import msgpack

from kvstore.api.nesting import value_too_deep

_BIN = {0xC4: (1, ">B"), 0xC5: (2, ">H"), 0xC6: (4, ">I")}
# Type byte -> total size of a fixed-size object (ints, floats, fixext).
_FIXED = {0xC0: 1, 0xC2: 1, 0xC3: 1, 0xCA: 5, 0xCB: 9, 0xCC: 2, 0xCD: 3, 0xCE: 5, 0xCF: 9,
          0xD0: 2, 0xD1: 3, 0xD2: 5, 0xD3: 9, 0xD4: 3, 0xD5: 4, 0xD6: 6, 0xD7: 10, 0xD8: 18}
# Type byte -> (width of its length field, extra bytes after the length) for sized objects.
_SIZED = {0xC4: (1, 0), 0xC5: (2, 0), 0xC6: (4, 0), 0xD9: (1, 0), 0xDA: (2, 0), 0xDB: (4, 0),
          0xC7: (1, 1), 0xC8: (2, 1), 0xC9: (4, 1)}


# Caps on what a field's value may unpack into, so a small body cannot make a huge object: the
# store refuses token lists past 2**21 anyway, and no field is a large map.
MAX_ARRAY_LEN = 1 << 21
MAX_MAP_LEN = 1 << 12


class FramingError(ValueError):
    """The body is not a well-formed msgpack map with string keys."""


def _uint(buf: memoryview, pos: int, width: int) -> int:
    if pos + width > len(buf):
        raise FramingError("truncated msgpack data")
    return int.from_bytes(buf[pos:pos + width], "big")


def _map_header(buf: memoryview) -> tuple[int, int]:
    """(number of entries, offset of the first key)."""
    if not len(buf):
        raise FramingError("empty body, expected a msgpack map")
    t = buf[0]
    if 0x80 <= t <= 0x8F:
        return t & 0x0F, 1
    if t == 0xDE:
        return _count(_uint(buf, 1, 2), MAX_MAP_LEN, "map"), 3
    if t == 0xDF:
        return _count(_uint(buf, 1, 4), MAX_MAP_LEN, "map"), 5
    raise FramingError("expected a msgpack map at the top level")


def _count(n: int, limit: int, kind: str) -> int:
    # Checked before walking: walking 10**7 declared elements costs seconds of Python.
    if n > limit:
        raise FramingError(f"{kind} of {n} entries exceeds the limit of {limit}")
    return n


def _skip(buf: memoryview, pos: int, max_depth: int | None = None, level: int = 1) -> int:
    """Offset just past the msgpack object at `pos` (nested objects included). `level`: how many
    containers the object sits at (counting itself, were it one); FramingError if that goes past
    `max_depth` (None: no limit but the body's length)."""
    # open[i]: objects still to read in the i-th open container (open[0] is the object itself).
    # Every object consumes at least one byte, so this loop is bounded by the body length even
    # when a header claims billions of elements.
    open_ = [1]
    while open_:
        if not open_[-1]:
            open_.pop()
            continue
        if pos >= len(buf):
            raise FramingError("truncated msgpack data")
        open_[-1] -= 1
        t, at = buf[pos], pos
        items = 0
        if t <= 0x7F or t >= 0xE0:
            pos += 1
            continue
        if t <= 0x8F:
            items = 2 * (t & 0x0F)
            pos += 1
        elif t <= 0x9F:
            items = t & 0x0F
            pos += 1
        elif t <= 0xBF:
            pos += 1 + (t & 0x1F)
            continue
        elif t in _FIXED:
            pos += _FIXED[t]
            continue
        elif t in _SIZED:
            width, extra = _SIZED[t]
            pos += 1 + width + extra + _uint(buf, pos + 1, width)
            continue
        elif t in (0xDC, 0xDD):
            width = 2 if t == 0xDC else 4
            items = _count(_uint(buf, pos + 1, width), MAX_ARRAY_LEN, "array")
            pos += 1 + width
        elif t in (0xDE, 0xDF):
            width = 2 if t == 0xDE else 4
            items = 2 * _count(_uint(buf, pos + 1, width), MAX_MAP_LEN, "map")
            pos += 1 + width
        else:  # 0xC1 is the one byte msgpack never uses
            raise FramingError(f"invalid msgpack type byte 0x{t:02x}")
        # A container (empty ones too) opens a level.
        if max_depth is not None and level + len(open_) - 1 > max_depth:
            raise _too_deep(at, max_depth)
        open_.append(items)
    if pos > len(buf):
        raise FramingError("truncated msgpack data")
    return pos


def _too_deep(pos: int, max_depth: int) -> FramingError:
    return FramingError(f"nested deeper than {max_depth} levels (at byte {pos}); no request field nests that deep")


SMALL_BODY_BYTES = 64 << 10  # below this, copying bins costs less than walking the map in Python


def unpack_map(body: bytes | bytearray | memoryview, max_depth: int | None = None) -> dict[str, Any]:
    """Decode a top-level msgpack map; `bin` values are memoryviews (slices of `body` when it is
    large; of writable copies when it is small). `max_depth`: the most containers the body may
    nest, its own map included (a request's schema bounds it; None for answers)."""
    buf = memoryview(body).cast("B")
    if len(buf) <= SMALL_BODY_BYTES:
        return _unpack_small(buf, max_depth)
    count, pos = _map_header(buf)
    if max_depth is not None and max_depth < 1:
        raise _too_deep(0, max_depth)
    out: dict[str, Any] = {}
    size = len(buf)
    for _ in range(count):
        if pos >= size:
            raise FramingError("truncated msgpack data")
        t = buf[pos]
        if 0xA0 <= t <= 0xBF:  # a short str, as every field name is: read here, not walked
            end = pos + 1 + (t & 0x1F)
            if end > size:
                raise FramingError("truncated msgpack data")
            key = _utf8(buf[pos + 1:end])
        else:
            end = _skip(buf, pos, max_depth, level=2)  # keys and values sit inside the body's map
            key = _unpack(buf[pos:end])
            if not isinstance(key, str):
                raise FramingError(f"map keys must be strings, got {reprlib.repr(key)}")
        pos = end
        if pos >= size:
            raise FramingError("truncated msgpack data")
        t = buf[pos]
        if t in _BIN:
            width, _ = _BIN[t]
            end = pos + 1 + width + _uint(buf, pos + 1, width)
            if end > size:
                raise FramingError("truncated msgpack data")
            out[key] = buf[pos + 1 + width:end]
        elif t <= 0x7F:  # a positive fixint
            end = pos + 1
            out[key] = t
        elif 0xA0 <= t <= 0xBF:  # a short str (a dtype's name): read here, not walked
            end = pos + 1 + (t & 0x1F)
            if end > size:
                raise FramingError("truncated msgpack data")
            out[key] = _utf8(buf[pos + 1:end])
        else:
            end = _skip(buf, pos, max_depth, level=2)
            out[key] = _unpack(buf[pos:end])
        pos = end
    if pos != len(buf):
        raise FramingError(f"{len(buf) - pos} trailing bytes after the msgpack map")
    return out


def _unpack_small(buf: memoryview, max_depth: int | None) -> dict[str, Any]:
    """msgpack's C unpacker (an order of magnitude faster than the walk above on small bodies),
    with the same checks and messages; top-level bins become writable memoryviews."""
    if not len(buf):
        raise FramingError("empty body, expected a msgpack map")
    containers = [0]
    try:
        if max_depth is None:  # an answer: no depth to count, no hooks to call
            obj = msgpack.unpackb(buf, raw=False, strict_map_key=False, max_array_len=MAX_ARRAY_LEN,
                                  max_map_len=MAX_MAP_LEN)
        else:
            def counted(container: Any) -> Any:  # called once per array and map, the body's own included
                containers[0] += 1
                return container

            obj = msgpack.unpackb(buf, raw=False, strict_map_key=False, max_array_len=MAX_ARRAY_LEN,
                                  max_map_len=MAX_MAP_LEN, list_hook=counted, object_hook=counted)
    except msgpack.StackError:  # its own bound on nesting (1,024 levels), raised with no message
        raise FramingError(f"nested deeper than {max_depth or 'msgpack allows'} levels "
                           "(past msgpack's own limit of 1024); no request field nests that deep") from None
    except msgpack.ExtraData as exc:
        if not isinstance(exc.unpacked, dict):
            raise FramingError("expected a msgpack map at the top level") from None
        raise FramingError(f"{len(exc.extra)} trailing bytes after the msgpack map") from None
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # TypeError: a map key that is a list or map
        raise FramingError(f"malformed msgpack: {exc}") from None
    if not isinstance(obj, dict):
        raise FramingError("expected a msgpack map at the top level")
    # No more containers than levels (a lookup's map and its token array): nothing to measure.
    if max_depth is not None and containers[0] > max_depth and value_too_deep(obj, max_depth):
        raise FramingError(f"nested deeper than {max_depth} levels; no request field nests that deep")
    for key, value in obj.items():  # values replaced in place: the map's size never changes
        if type(key) is not str:
            raise FramingError(f"map keys must be strings, got {reprlib.repr(key)}")
        if type(value) is bytes:
            obj[key] = memoryview(bytearray(value))
    return obj


def _utf8(data: memoryview) -> str:
    try:
        return str(data, "utf-8")
    except UnicodeDecodeError as exc:
        raise FramingError(f"malformed msgpack: {exc}") from None


def _unpack(data: memoryview) -> Any:
    try:
        return msgpack.unpackb(data, raw=False, strict_map_key=False, max_array_len=MAX_ARRAY_LEN,
                               max_map_len=MAX_MAP_LEN)
    except (ValueError, TypeError, msgpack.UnpackException) as exc:  # bad utf-8, ext types, unhashable keys
        raise FramingError(f"malformed msgpack: {exc}") from None


def bin_header(nbytes: int) -> bytes:
    if nbytes < 1 << 8:
        return struct.pack(">BB", 0xC4, nbytes)
    if nbytes < 1 << 16:
        return struct.pack(">BH", 0xC5, nbytes)
    if nbytes < 1 << 32:
        return struct.pack(">BI", 0xC6, nbytes)
    raise ValueError(f"bin of {nbytes} bytes exceeds msgpack's 4 GiB limit")


def pack_map_prefix(fields: Mapping[str, Any], bin_key: str, bin_nbytes: int) -> bytes:
    """msgpack of `{**fields, bin_key: <bin of bin_nbytes>}` up to, not including, the bin data.

    Send the returned bytes, then exactly `bin_nbytes` raw bytes: the map is then complete.
    The fields are packed by one msgpack call (one per field cost several times more), whose
    map header, for one entry fewer, is swapped for the whole map's.
    """
    count = len(fields)
    packed = msgpack.packb(fields, use_bin_type=True)
    skip = len(_map_header_bytes(count))  # the header msgpack wrote for `count` entries
    return b"".join((_map_header_bytes(count + 1), memoryview(packed)[skip:], msgpack.packb(bin_key),
                     bin_header(bin_nbytes)))


def _map_header_bytes(count: int) -> bytes:
    if count <= 15:
        return bytes((0x80 | count,))
    if count <= 0xFFFF:
        return struct.pack(">BH", 0xDE, count)
    return struct.pack(">BI", 0xDF, count)
