"""A store's pages land bit-exact in the CPU slab however the caller's KV is laid out: a
contiguous tensor is copied as bytes (all of it for a one-page store, else each page's run of
every layer's K and V rows), a strided one through a typed view; and token lists on both sides
of the short-list packer's limit are the same prompt, with the same errors."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from kv_tensors import random_kv

from kvstore.errors import InvalidTokens
from kvstore.validation import SMALL_TOKEN_LIST, token_bytes


@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
@pytest.mark.parametrize("n_tokens", [3, 4, 10, 12])  # a tail page alone, one page, pages and a tail, pages
def test_contiguous_kv_of_any_length_round_trips_bit_exact(make_store, spec, dtype, n_tokens):
    spec = dataclasses.replace(spec, dtype=dtype)
    store = make_store(disk_bytes=0)
    store.register_model("m", spec)
    tokens = list(range(100, 100 + n_tokens))
    kv = random_kv(spec, n_tokens, seed=n_tokens)
    assert kv.is_contiguous()
    result = store.store("m", tokens, kv)
    assert (result.stored_tokens, result.new_pages) == (n_tokens, -(-n_tokens // spec.page_size))
    for start in range(n_tokens):
        got = store.fetch("m", tokens, start=start)
        assert got.matched_tokens == n_tokens and got.kv.dtype == kv.dtype
        assert torch.equal(got.kv, kv[:, :, start:])


def test_pages_of_two_stores_sharing_a_prefix_keep_their_own_bytes(make_store, spec):
    store = make_store(disk_bytes=0)
    store.register_model("m", spec)
    first, second = list(range(1, 11)), list(range(1, 9)) + [50, 51, 52]
    kv1, kv2 = random_kv(spec, 10, seed=1), random_kv(spec, 11, seed=2)
    assert store.store("m", first, kv1).new_pages == 3
    assert store.store("m", second, kv2).new_pages == 1  # its first two pages are cached
    assert torch.equal(store.fetch("m", first).kv, kv1)
    got = store.fetch("m", second)
    assert got.matched_tokens == 11
    assert torch.equal(got.kv[:, :, :8], kv1[:, :, :8]) and torch.equal(got.kv[:, :, 8:], kv2[:, :, 8:])


@pytest.mark.parametrize("start", [4, 6])  # on a page boundary, inside a page (the head is fetched)
def test_store_with_start_copies_only_the_new_tokens(make_store, spec, start):
    store = make_store(disk_bytes=0)
    store.register_model("m", spec)
    tokens = list(range(1, 15))
    kv = random_kv(spec, 14, seed=3)
    assert store.store("m", tokens[:start], kv[:, :, :start].contiguous()).stored_tokens == start
    assert store.store("m", tokens, kv[:, :, start:].contiguous(), start=start).stored_tokens == 14
    got = store.fetch("m", tokens)
    assert got.matched_tokens == 14 and torch.equal(got.kv, kv)


def test_kv_viewing_a_larger_tensor_is_copied_from_its_own_elements(make_store, spec):
    store = make_store(disk_bytes=0)
    store.register_model("m", spec)
    big = random_kv(spec, 20, seed=4)
    window = big[:, :, 5:15]  # a strided view into a larger tensor
    assert not window.is_contiguous()
    assert store.store("m", list(range(10)), window).stored_tokens == 10
    assert torch.equal(store.fetch("m", list(range(10))).kv, big[:, :, 5:15])


@pytest.mark.parametrize("n", [0, 1, SMALL_TOKEN_LIST, SMALL_TOKEN_LIST + 1, 3 * SMALL_TOKEN_LIST])
def test_token_lists_either_side_of_the_short_list_limit_are_int32_le(n):
    ids = [(i * 7919) % (1 << 31) for i in range(n)]
    ids[-1:] = [(1 << 31) - 1] if n else []
    assert token_bytes(ids, max_tokens=1 << 20) == np.array(ids, dtype="<i4").tobytes()
    assert token_bytes([np.int64(i) for i in ids], max_tokens=1 << 20) == np.array(ids, dtype="<i4").tobytes()


@pytest.mark.parametrize("n", [1, SMALL_TOKEN_LIST, SMALL_TOKEN_LIST + 1])
@pytest.mark.parametrize("bad", [-1, 1 << 31, 1 << 64])
def test_out_of_range_ids_are_refused_either_side_of_the_limit(n, bad):
    ids = [5] * (n - 1) + [bad]
    with pytest.raises(InvalidTokens, match=r"tokens: token ids must be in \[0, 2147483647\]"):
        token_bytes(ids, max_tokens=1 << 20)


@pytest.mark.parametrize("n", [1, SMALL_TOKEN_LIST, SMALL_TOKEN_LIST + 1])
def test_bools_and_floats_are_refused_either_side_of_the_limit(n):
    for bad in (True, 1.0):
        with pytest.raises(InvalidTokens, match="tokens: every token id must be an integer"):
            token_bytes([5] * (n - 1) + [bad], max_tokens=1 << 20)


@pytest.mark.parametrize("n", [1, SMALL_TOKEN_LIST, SMALL_TOKEN_LIST + 1])
def test_int32_arrays_are_checked_either_side_of_the_limit(n):
    # The sidecar's tokens: an int32 LE view of the request body.
    ids = np.array([(i * 7919) % (1 << 31) for i in range(n - 1)] + [(1 << 31) - 1], dtype="<i4")
    assert token_bytes(ids, max_tokens=1 << 20) == ids.tobytes()
    for at in (0, n - 1):
        bad = ids.copy()
        bad[at] = -1
        with pytest.raises(InvalidTokens, match=r"tokens: token ids must be in \[0, 2147483647\]"):
            token_bytes(bad, max_tokens=1 << 20)
