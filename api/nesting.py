"""How deeply a request body nests, checked before it is decoded into objects.

No request field nests deeper than a few levels (wire.MAX_BODY_DEPTH), but the decoders would
follow a body as deep as it goes: `json.loads` recurses once per `[` or `{` and raises
RecursionError near 1,000 levels (a 500, not a 400), msgpack's C unpacker stops at 1,024 levels
with an empty message, and anything that prints such a value (`repr`) recurses again. So a body
that nests deeper than the schema can is refused here, before it is decoded.

- JSON: the body is reduced to its brackets and quotes (`bytes.translate`, escapes blanked
  first), and the depth of `[ {` outside strings is followed through that: in a loop when it is
  short, vectorized in chunks when it is long (a body of a million `[]` costs milliseconds, not
  seconds). The common body has at most a few openers in all, and `str.count` settles it.
- msgpack: framing.py walks its large bodies object by object and counts levels as it goes;
  its small bodies are decoded by msgpack's C unpacker (bounded), which counts the containers
  it builds; only a body with more containers than levels (a blend's chunks as arrays) has its
  values measured here (`value_too_deep`: a C-speed pass over each list's element types).
"""
from __future__ import annotations

import re
from typing import Any

import numpy as np

SCAN_CHUNK_BYTES = 1 << 20  # the vectorized scan's working set: a few MiB, whatever the body's size
LOOP_BYTES = 4096  # below this many brackets and quotes a plain loop beats numpy's per-call costs
_STRUCTURE = b'[]{}"'
_NOT_STRUCTURE = bytes(sorted(set(range(256)) - set(_STRUCTURE)))
_STEP = np.zeros(256, dtype=np.int8)  # byte -> change of depth outside strings
_STEP[[ord("["), ord("{")]] = 1
_STEP[[ord("]"), ord("}")]] = -1
_QUOTE = ord('"')
_OPENERS = frozenset(b"[{")
_ESCAPE = re.compile(rb"\\.", re.DOTALL)
_CONTAINERS = (list, dict)
_CONTAINER_TYPES = frozenset(_CONTAINERS)  # decoders build exactly these, never subclasses


def json_too_deep(body: bytes | bytearray | memoryview, text: str, max_depth: int) -> bool:
    """Whether `body` (UTF-8 JSON; `text` is it decoded) nests deeper than `max_depth`
    containers. Exact for any prefix json.loads would accept, which is all that json.loads
    recurses through before it stops at the first error."""
    if _found(text, "[", max_depth) + _found(text, "{", max_depth) <= max_depth:
        return False  # fewer openers than levels: the usual request, settled at memchr speed
    raw = bytes(body)
    if b"\\" in raw:  # blank every escape pair (\" among them) so that quotes alone delimit strings
        raw = _ESCAPE.sub(b"__", raw)
    structure = raw.translate(None, _NOT_STRUCTURE)  # brackets and quotes, in order (C speed)
    if len(structure) <= LOOP_BYTES:
        depth, in_string = 0, False
        for byte in structure:
            if byte == _QUOTE:
                in_string = not in_string
            elif in_string:
                continue
            elif byte in _OPENERS:
                depth += 1
                if depth > max_depth:
                    return True
            else:
                depth -= 1
        return False
    marks = np.frombuffer(structure, dtype=np.uint8)
    depth, quote_parity = 0, 0  # quote_parity 1: the chunk starts inside a string
    for begin in range(0, marks.size, SCAN_CHUNK_BYTES):
        part = marks[begin:begin + SCAN_CHUNK_BYTES]
        quotes = np.cumsum(part == _QUOTE, dtype=np.int32)
        inside = ((quotes + quote_parity) & 1).astype(bool)  # an opening quote counts as inside, a closing one outside
        levels = depth + np.cumsum(np.where(inside, 0, _STEP[part]), dtype=np.int32)
        if int(levels.max()) > max_depth:
            return True
        depth, quote_parity = int(levels[-1]), (quote_parity + int(quotes[-1])) & 1
    return False


def _found(text: str, char: str, enough: int) -> int:
    """How many times `char` occurs in `text`, counted up to `enough + 1` (str.find is memchr;
    str.count walks every character)."""
    found, at = 0, -1
    while found <= enough:
        at = text.find(char, at + 1)
        if at < 0:
            break
        found += 1
    return found


def value_too_deep(value: Any, max_depth: int) -> bool:
    """Whether a decoded value nests more than `max_depth` containers (a scalar nests 0)."""
    if type(value) not in _CONTAINER_TYPES:
        return False
    if max_depth <= 0:
        return True
    items = value.values() if type(value) is dict else value
    if _CONTAINER_TYPES.isdisjoint(map(type, items)):  # one C-speed pass; only containers are followed
        return False
    for item in items:
        if type(item) in _CONTAINER_TYPES and value_too_deep(item, max_depth - 1):
            return True
    return False
