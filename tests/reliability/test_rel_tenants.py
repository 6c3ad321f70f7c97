"""Tenants through a real sidecar with an auth file: identical tokens never cross tenants
(lookup 0, fetch 0, blend misses), B's DELETE of the same model name leaves A's pages, unknown tokens get 401."""
from __future__ import annotations

import json

import pytest
import torch

from kvstore.api.client import KVStoreClient
from bench.reliability.pages import SPEC, expected_kv
from bench.engines import Sidecar
from kvstore.errors import ModelNotFound, Unauthorized


def test_tenants_never_see_each_other(tmp_path):
    auth = tmp_path / "auth.json"
    auth.write_text(json.dumps({"token-a-0123456789": "a", "token-b-0123456789": "b"}))
    sidecar = Sidecar(tmp_path / "data", ["--auth-file", str(auth), "--disk-bytes", "64MiB"]).start()
    tokens = list(range(100, 180))
    try:
        with KVStoreClient(sidecar.url, token="token-a-0123456789") as a, \
                KVStoreClient(sidecar.url, token="token-b-0123456789") as b, \
                KVStoreClient(sidecar.url, token="token-c-unknown") as c:
            a.register_model("m", SPEC)
            with pytest.raises(ModelNotFound):
                b.lookup("m", tokens)
            b.register_model("m", SPEC)
            assert a.store("m", tokens, expected_kv(SPEC, tokens)).stored_tokens == 80
            assert b.lookup("m", tokens).matched_tokens == 0
            assert b.fetch("m", tokens).matched_tokens == 0
            chunk = list(range(500, 532))
            a.store_chunk("m", chunk, expected_kv(SPEC, chunk))
            assert a.blend("m", [chunk]).hits == [True] and b.blend("m", [chunk]).hits == [False]
            assert b.drop_model("m") == 0
            assert torch.equal(a.fetch("m", tokens).kv, expected_kv(SPEC, tokens))
            with pytest.raises(Unauthorized):
                c.lookup("m", tokens)
            with pytest.raises(Unauthorized):
                c.drop_model("m")
            assert a.lookup("m", tokens).matched_tokens == 80
    finally:
        sidecar.kill()
