"""The zero-copy msgpack map reader on bodies past SMALL_BODY_BYTES (the hand-walked path): the
same values as msgpack's own decoder, bins as views of the body, and a clear FramingError for a
body cut short or malformed anywhere."""
from __future__ import annotations

import msgpack
import pytest

from kvstore.api.framing import SMALL_BODY_BYTES, FramingError, pack_map_prefix, unpack_map

KV = bytes(range(256)) * ((SMALL_BODY_BYTES // 256) + 1)  # a bin that makes the body large


def test_a_large_body_decodes_as_msgpack_does_with_its_bin_in_place():
    fields = {"matched_tokens": 2, "big": 1 << 40, "dtype": "float16", "shape": [8, 2, 2, 8, 128],
              "shm": {"offset": 4096, "nbytes": 65536}, "neg": -3, "f": 0.5, "none": None,
              "a_long_field_name_of_more_than_31_bytes": True}
    body = bytearray(pack_map_prefix(fields, "kv", len(KV)) + KV)
    out = unpack_map(body)
    kv = out.pop("kv")
    assert out == fields
    assert isinstance(kv, memoryview) and kv.tobytes() == KV
    kv[0] = 0xFF  # a view of the body, not a copy
    assert body[len(body) - len(KV)] == 0xFF


@pytest.mark.parametrize("count", [0, 1, 14, 15, 16, 0xFFFE, 0xFFFF, 0x10000])
def test_a_map_prefix_and_its_bin_are_the_msgpack_of_the_whole_map(count: int):
    # Either side of each msgpack map header size (fixmap to 15 entries, map16, map32).
    fields = {f"f{i}": i for i in range(count)}
    assert pack_map_prefix(fields, "kv", 3) + b"xyz" == msgpack.packb({**fields, "kv": b"xyz"}, use_bin_type=True)


def test_a_large_body_cut_short_is_a_framing_error():
    big_bin = b"\xa2kv\xc6" + len(KV).to_bytes(4, "big") + KV
    for body in (b"\x81" + big_bin[:-1],  # the bin ends past the body
                 b"\x82" + big_bin,  # one entry fewer than the map declares
                 b"\x82" + big_bin + b"\xa1x",  # a key without its value
                 b"\x82" + big_bin + b"\xa5x",  # a key running past the end
                 b"\x82" + big_bin + b"\xa1x\xa5abc"):  # a str value running past the end
        with pytest.raises(FramingError, match="truncated"):
            unpack_map(body)


def test_a_large_body_with_a_key_that_is_not_utf8_or_not_a_string_is_refused():
    bad_utf8 = b"\x82" + b"\xa2\xff\xfe" + b"\x01" + b"\xa2kv" + b"\xc6" + len(KV).to_bytes(4, "big") + KV
    with pytest.raises(FramingError, match="malformed msgpack"):
        unpack_map(bad_utf8)
    bad_utf8_value = b"\x82" + b"\xa1x" + b"\xa2\xff\xfe" + b"\xa2kv" + b"\xc6" + len(KV).to_bytes(4, "big") + KV
    with pytest.raises(FramingError, match="malformed msgpack"):
        unpack_map(bad_utf8_value)
    int_key = b"\x82" + b"\x07" + b"\x01" + b"\xa2kv" + b"\xc6" + len(KV).to_bytes(4, "big") + KV
    with pytest.raises(FramingError, match="map keys must be strings"):
        unpack_map(int_key)
    trailing = msgpack.packb({"kv": KV}, use_bin_type=True) + b"\x00"
    with pytest.raises(FramingError, match="1 trailing bytes"):
        unpack_map(trailing)
