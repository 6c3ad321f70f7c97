"""A request's cache_salt through the connector's link, on every backend a user can give it: an
in-process store, the loopback sidecar that serves an in-process store to vLLM's worker process,
a plain `kvstore serve` without an auth file, and one with an auth file (the salt inside the
bearer token's tenant). A salted request hits what its own salt stored,
never another salt's or an unsalted request's pages."""
from __future__ import annotations

import json
import types
from typing import Iterator

import pytest
import torch

from integrations.sidecar_process import Sidecar
from kvstore import KVStoreClient, ModelSpec, StoreConfig
from kvstore.api.server.in_process import InProcessSidecar
from kvstore.integrations.connector_config import ConnectorConfig
from kvstore.integrations.store_link import StoreLink
from kvstore.integrations.vllm_scheduler import SchedulerSide

BLOCK = 32
SPEC = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="bfloat16", page_size=16)
PROMPT = list(range(1, 129))  # 4 blocks: a hit is at most 3 (the last token is always computed)


@pytest.fixture(params=["in-process", "loopback-sidecar", "kvstore-serve", "kvstore-serve-auth"])
def backend(request, tmp_path) -> Iterator[tuple[StoreLink, str, str | None]]:
    """(the connector's link, the URL a client can check the store at ("" in-process), its token)."""
    if request.param == "in-process":
        config = ConnectorConfig.from_extra_config({"data_dir": str(tmp_path), "cpu_bytes": "16MiB",
                                                    "disk_bytes": 0})
        link = StoreLink(config, "m", SPEC)
        yield link, "", None
        link.close()
    elif request.param == "loopback-sidecar":
        store_config = StoreConfig(data_dir=str(tmp_path), cpu_bytes=16 << 20, disk_bytes=0)
        config = ConnectorConfig.from_extra_config({"data_dir": str(tmp_path), "cpu_bytes": "16MiB",
                                                    "disk_bytes": 0})
        with InProcessSidecar(store_config) as url:
            link = StoreLink(config, "m", SPEC, url=url)  # what the connector gives its worker process
            yield link, url, None
            link.close()
    else:
        token = "tok-acme-0123456789" if request.param.endswith("auth") else None
        auth = None
        if token:
            auth = tmp_path / "auth.json"
            auth.write_text(json.dumps({token: "acme"}))
        sidecar = Sidecar(tmp_path / "data", auth, default_token=token, cpu_bytes="16MiB", disk_bytes="0")
        sidecar.start()
        link = StoreLink(ConnectorConfig.from_extra_config({"url": sidecar.url, "token": token} if token
                                                           else {"url": sidecar.url}), "m", SPEC)
        try:
            yield link, sidecar.url, token
        finally:
            link.close()
            sidecar.kill()


def request(req_id: str, salt: str | None):
    return types.SimpleNamespace(request_id=req_id, prompt_token_ids=PROMPT, cache_salt=salt, mm_features=[],
                                 lora_request=None, prompt_embeds=None)


def test_a_salted_request_hits_its_own_salt_and_nothing_else(backend):
    link, url, token = backend
    kv = torch.randn(SPEC.kv_shape(len(PROMPT))).to(torch.bfloat16)
    assert link.store(PROMPT, kv, 0, "s1") == len(PROMPT)
    side = SchedulerSide(link, BLOCK)
    for req_id, salt, hit in (("a", "s1", 96), ("b", "s2", 0), ("c", None, 0)):
        r = request(req_id, salt)
        side.on_new_request(r)
        assert side.matched_tokens(r, 0) == hit, salt
    matched, got = link.fetch(PROMPT[:96], 32, "s1")  # what the worker loads
    assert matched == 96 and torch.equal(got, kv[:, :, 32:96])
    assert link.fetch(PROMPT[:96], 0, "s2") == (0, None)
    if url:  # the sidecar holds it under the salt, in the tenant of the connector's token
        with KVStoreClient(url, token=token) as client:
            assert client.lookup("m", PROMPT, salt="s1").matched_tokens == len(PROMPT)
            assert client.lookup("m", PROMPT).matched_tokens == 0


def test_an_unsalted_request_never_sees_a_salted_one_and_the_reverse(backend):
    link, _, _ = backend
    plain = torch.randn(SPEC.kv_shape(len(PROMPT))).to(torch.bfloat16)
    salted = torch.randn(SPEC.kv_shape(len(PROMPT))).to(torch.bfloat16)
    link.store(PROMPT, plain, 0, None)
    link.store(PROMPT, salted, 0, "conv-42")
    assert torch.equal(link.fetch(PROMPT, 0, None)[1], plain)
    assert torch.equal(link.fetch(PROMPT, 0, "conv-42")[1], salted)
