"""Token ids of every integer type are the same prompt, in-process and through the client's
encoder: lists of numpy or torch integer scalars included (anything operator.index takes);
floats, bools and ids outside [0, 2**31 - 1] are refused with the same clear error."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from kv_tensors import random_kv

from kvstore.api.client.codec import tokens_bin
from kvstore.errors import InvalidTokens
from kvstore.validation import token_bytes

IDS = [0, 1, 7, 100, 127, 3, 9, 12]  # fit every integer type, int8 included
NUMPY_INTS = [np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64]
TORCH_INTS = [torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8]

ACCEPTED = {
    "list of ints": lambda: list(IDS),
    "tuple of ints": lambda: tuple(IDS),
    **{f"list of numpy {t.__name__}": (lambda t=t: [t(i) for i in IDS]) for t in NUMPY_INTS},
    **{f"list of torch {t} scalars": (lambda t=t: list(torch.tensor(IDS, dtype=t))) for t in TORCH_INTS},
    "list of one-element torch tensors": lambda: [torch.tensor([i]) for i in IDS],
    "list of 0-d numpy arrays": lambda: [np.array(i) for i in IDS],
    "mixed ints, numpy and torch scalars": lambda: [IDS[0], np.int64(IDS[1]), torch.tensor(IDS[2]), *IDS[3:]],
    **{f"numpy {t.__name__} array": (lambda t=t: np.array(IDS, dtype=t)) for t in NUMPY_INTS},
    **{f"torch {t} tensor": (lambda t=t: torch.tensor(IDS, dtype=t)) for t in TORCH_INTS},
}

NOT_INTEGERS = {
    "a float": [1.0, *IDS[1:]],
    "a numpy float32": [np.float32(1), *IDS[1:]],
    "a numpy float64": [np.float64(1), *IDS[1:]],
    "a torch float scalar": [torch.tensor(1.0), *IDS[1:]],
    "a bool": [True, *IDS[1:]],
    "a numpy bool": [np.bool_(True), *IDS[1:]],
    "a torch bool scalar": [torch.tensor(True), *IDS[1:]],
    "a 0-d numpy bool array": [np.array(True), *IDS[1:]],
    "a string": ["1", *IDS[1:]],
    "None": [None, *IDS[1:]],
    "a two-element tensor": [torch.tensor([1, 2]), *IDS[1:]],
}
OUT_OF_RANGE = {
    "a negative int": [-1, *IDS[1:]],
    "a negative numpy int64": [np.int64(-1), *IDS[1:]],
    "a negative torch scalar": [torch.tensor(-1), *IDS[1:]],
    "2**31 as an int": [2**31, *IDS[1:]],
    "2**31 as a numpy int64": [np.int64(2**31), *IDS[1:]],
    "2**63 as a numpy uint64": [np.uint64(2**63), *IDS[1:]],
    "2**40 as a torch scalar": [torch.tensor(2**40), *IDS[1:]],
}
EXPECTED_BYTES = np.array(IDS, dtype="<i4").tobytes()


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_every_integer_type_is_the_same_prompt_in_process(make_store, spec, name):
    store = make_store()
    store.register_model("m", spec)
    kv = random_kv(spec, len(IDS))
    assert store.store("m", ACCEPTED[name](), kv).stored_tokens == len(IDS)
    assert store.lookup("m", list(IDS)).matched_tokens == len(IDS)  # the very pages a list of ints names
    assert store.lookup("m", ACCEPTED[name]()).matched_tokens == len(IDS)
    fetched = store.fetch("m", ACCEPTED[name](), start=2)
    assert fetched.matched_tokens == len(IDS) and torch.equal(fetched.kv, kv[:, :, 2:])


@pytest.mark.parametrize("name", list(ACCEPTED))
def test_every_integer_type_is_the_same_prompt_on_the_wire(name):
    assert bytes(tokens_bin(ACCEPTED[name]())) == EXPECTED_BYTES
    assert token_bytes(ACCEPTED[name](), max_tokens=64) == EXPECTED_BYTES


@pytest.mark.parametrize("name", list(NOT_INTEGERS))
def test_non_integers_are_refused_everywhere(make_store, spec, name):
    store = make_store()
    store.register_model("m", spec)
    tokens = NOT_INTEGERS[name]
    with pytest.raises(InvalidTokens, match="tokens: every token id must be an integer"):
        store.store("m", tokens, random_kv(spec, len(tokens)))
    with pytest.raises(InvalidTokens, match="tokens: every token id must be an integer"):
        store.lookup("m", tokens)
    with pytest.raises(InvalidTokens, match="tokens: every token id must be an integer"):
        tokens_bin(tokens)
    with pytest.raises(InvalidTokens, match=r"chunks\[1\]: every token id must be an integer"):
        store.blend("m", [list(IDS), tokens])
    assert store.stats()["pages"] == 0


@pytest.mark.parametrize("name", list(OUT_OF_RANGE))
def test_out_of_range_ids_are_refused_everywhere(make_store, spec, name):
    store = make_store()
    store.register_model("m", spec)
    tokens = OUT_OF_RANGE[name]
    with pytest.raises(InvalidTokens, match=r"tokens: token ids must be in \[0, 2147483647\]"):
        store.store("m", tokens, random_kv(spec, len(tokens)))
    with pytest.raises(InvalidTokens, match=r"tokens: token ids must be in \[0, 2147483647\]"):
        tokens_bin(tokens)
    assert store.stats()["pages"] == 0


@pytest.mark.parametrize("array", [np.array([1.0, 2.0]), np.array([True, False]), torch.tensor([1.5]),
                                   torch.tensor([True]), np.array([[1, 2]])])
def test_non_integer_arrays_are_refused_by_the_client_too(array):
    with pytest.raises(InvalidTokens, match="tokens"):
        tokens_bin(array)
