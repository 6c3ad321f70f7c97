"""Random bytes into the request decoder and the LMDB record decoder raise only their documented
errors (InvalidRequest, CorruptRecord); bombs are refused cheaply."""
from __future__ import annotations

import resource
import time

import msgpack
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvstore.api.framing import unpack_map
from kvstore.api.server.wire import decode_msgpack, fetch_request, lookup_request, store_request
from kvstore.errors import InvalidRequest
from kvstore.tiers.disk_record import CorruptRecord, decode_header

FAST = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
msgpack_values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**63, 2**64 - 1) | st.floats() | st.text(max_size=20)
    | st.binary(max_size=40),
    lambda inner: st.lists(inner, max_size=6) | st.dictionaries(st.text(max_size=8), inner, max_size=6), max_leaves=30)


@FAST
@given(st.binary(max_size=300))
def test_random_bytes_into_the_request_decoder(body):
    try:
        decode_msgpack(bytearray(body))
    except InvalidRequest:
        pass


@FAST
@given(st.dictionaries(st.sampled_from(["model", "tokens", "kv", "start", "dtype", "x"]), msgpack_values, max_size=6))
def test_random_maps_into_the_request_parsers(fields):
    try:  # maps nested deeper than any request are refused by the decoder already
        body = decode_msgpack(bytearray(msgpack.packb(fields, use_bin_type=True)))
    except InvalidRequest as exc:
        assert "nested deeper" in exc.message
        return
    for parse in (lookup_request, fetch_request, store_request):
        try:
            parse(body)
        except InvalidRequest:
            pass


@FAST
@given(st.binary(max_size=300), st.binary(min_size=16, max_size=16))
def test_random_bytes_into_the_record_decoder(value, key):
    with pytest.raises(CorruptRecord):
        decode_header(value, key)


@FAST
@given(msgpack_values, st.binary(min_size=16, max_size=16))
def test_well_checksummed_garbage_headers_are_corrupt_records(header, key):
    import zlib
    packed = msgpack.packb(header, use_bin_type=True)
    with pytest.raises(CorruptRecord):
        decode_header((zlib.crc32(packed) & 0xFFFFFFFF).to_bytes(4, "little") + packed, key)


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


BOMBS = {
    # a map header claiming 4 billion entries in a 5-byte body
    "map of 2**32-1 entries": b"\xdf\xff\xff\xff\xff",
    # an array header claiming 4 billion tokens, no elements
    "array of 2**32-1 tokens": b"\x81\xa6tokens\xdd\xff\xff\xff\xff",
    # a bin claiming 4 GiB
    "bin of 4 GiB": b"\x81\xa2kv\xc6\xff\xff\xff\xff" + b"x" * 16,
    # 100k nested arrays (recursion bomb)
    "nested arrays": b"\x81\xa6tokens" + b"\x91" * 100_000 + b"\x01",
    # 100k nested maps
    "nested maps": b"\x81\xa6tokens" + b"\x81\xa1a" * 100_000 + b"\x01",
    # 10**7 one-byte tokens: 10 MB of body that would unpack into an 80 MB list
    "10**7 tokens": b"\x82\xa5model\xa1m\xa6tokens\xdd" + (10**7).to_bytes(4, "big") + b"\x01" * 10**7,
}


@pytest.mark.parametrize("name", list(BOMBS))
def test_bombs_are_refused_cheaply(name):
    before = _peak_rss_bytes()
    began = time.perf_counter()
    with pytest.raises(InvalidRequest):
        lookup_request(decode_msgpack(bytearray(BOMBS[name])))
    assert time.perf_counter() - began < 2.0
    assert _peak_rss_bytes() - before < 64 << 20


def test_unpack_map_views_bins_without_copying():
    body = bytearray(msgpack.packb({"kv": b"abc"}, use_bin_type=True))
    assert isinstance(unpack_map(body)["kv"], memoryview)


def _decoded(body: bytes, small_limit: int):
    import kvstore.api.framing as framing

    saved, framing.SMALL_BODY_BYTES = framing.SMALL_BODY_BYTES, small_limit
    try:
        out = unpack_map(body)
        return {k: bytes(v) if isinstance(v, memoryview) else v for k, v in out.items()}
    except Exception as exc:  # noqa: BLE001 - the type is what is compared
        return type(exc).__name__
    finally:
        framing.SMALL_BODY_BYTES = saved


@FAST
@given(st.one_of(st.binary(max_size=200),
                 st.dictionaries(st.text(max_size=8) | st.integers(0, 9), msgpack_values, max_size=6).map(
                     lambda d: msgpack.packb(d, use_bin_type=True)),
                 st.tuples(st.dictionaries(st.text(max_size=8), msgpack_values, max_size=4),
                           st.binary(min_size=1, max_size=4))
                 .map(lambda p: msgpack.packb(p[0], use_bin_type=True) + p[1])))
def test_small_and_large_body_decoders_agree(body):
    """Small bodies go through msgpack's C unpacker, large ones through the zero-copy walker:
    the same bytes must give the same map or the same error (FramingError) either way."""
    small, walked = _decoded(body, 1 << 20), _decoded(body, -1)
    if isinstance(small, dict) and isinstance(walked, dict):  # compared packed: NaN != NaN
        assert msgpack.packb(small, use_bin_type=True) == msgpack.packb(walked, use_bin_type=True)
    else:
        assert small == walked == "FramingError", (small, walked)


@pytest.mark.parametrize("dtype", [[1], {"a": 1}, b"float16", 7])
def test_a_dtype_that_is_not_a_string_is_refused_by_name(dtype):
    """An unhashable dtype (a list, a map, a bin) once raised TypeError from the dict lookup: a 500."""
    from kvstore.errors import InvalidKV

    body = decode_msgpack(bytearray(msgpack.packb({"model": "m", "tokens": [1], "kv": b"", "dtype": dtype},
                                                  use_bin_type=True)))
    with pytest.raises(InvalidKV, match="dtype: must be one of"):
        store_request(body)
