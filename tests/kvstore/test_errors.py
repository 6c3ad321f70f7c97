"""The error hierarchy: every error class a server raises is the class a client raises back, by
its wire code, with the HTTP status its class keywords (or its parent's) give."""
from __future__ import annotations

import pytest

from kvstore import errors
from kvstore.errors import ERRORS_BY_CODE, InvalidRequest, InvalidTokens, KVStoreError, ModelNotFound


def all_subclasses(cls: type) -> list[type]:
    return [c for sub in cls.__subclasses__() for c in (sub, *all_subclasses(sub))]


def test_every_error_is_registered_under_its_own_code():
    classes = [KVStoreError, *all_subclasses(KVStoreError)]
    assert len(classes) >= 18
    assert {cls.code: cls for cls in classes} == ERRORS_BY_CODE
    assert len({cls.code for cls in classes}) == len(classes)
    for cls in classes:
        assert cls.__module__ == errors.__name__ and cls.__doc__, cls


def test_a_status_left_out_is_the_parents():
    assert (InvalidRequest.status, InvalidTokens.status) == (400, 400)
    assert (ModelNotFound.code, ModelNotFound.status) == ("model_not_found", 404)
    err = InvalidTokens("tokens: bad", field="tokens")
    assert isinstance(err, InvalidRequest) and (err.message, err.field) == ("tokens: bad", "tokens")


def test_a_second_class_under_one_code_is_refused():
    with pytest.raises(TypeError, match="model_not_found"):
        class Another(KVStoreError, code="model_not_found", status=404):
            """A copy."""
    assert ERRORS_BY_CODE["model_not_found"] is ModelNotFound
