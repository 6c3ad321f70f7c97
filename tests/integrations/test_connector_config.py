"""kv_connector_extra_config: sidecar or in-process settings, sizes with units, bad keys named;
the store's model name and spec are the decode loop's for the same checkpoint."""
from __future__ import annotations

import types

import pytest

from kvstore.integrations.connector_config import ConnectorConfig
from kvstore.integrations.vllm_model import model_spec, store_model_name


def test_sidecar_settings_with_per_salt_tokens():
    config = ConnectorConfig.from_extra_config({"url": "http://127.0.0.1:8100", "token": "t0",
                                                "tokens": {"alice": "ta", "bob": "tb"}, "timeout_s": 2,
                                                "shared_memory_bytes": "0"})
    assert config.shared_memory_bytes == 0
    assert config.url == "http://127.0.0.1:8100" and config.store is None and config.timeout_s == 2
    assert config.token_for(None) == "t0" and config.token_for("alice") == "ta"
    assert config.token_for("eve") == "t0"  # a salt with no token of its own: the connector's tenant, salted


def test_in_process_settings_take_kvstore_serve_names_and_units(tmp_path):
    config = ConnectorConfig.from_extra_config({"data_dir": str(tmp_path), "cpu_bytes": "64MiB", "disk_bytes": "1GiB",
                                                "policy": "lru", "model": "llama", "redis_timeout_s": 1})
    assert config.url is None and config.model == "llama"
    assert config.store.cpu_bytes == 64 << 20 and config.store.disk_bytes == 1 << 30 and config.store.policy == "lru"
    assert config.store.redis_timeout_s == 1.0


@pytest.mark.parametrize("extra, named", [
    ({"url": "http://h:1", "cpu_byts": "1GiB"}, "cpu_byts"),
    ({"url": "http://h:1", "cpu_bytes": "1GiB"}, "cpu_bytes"),
    ({"token": "t"}, "token"),
    ({"shared_memory_bytes": "1MiB"}, "shared_memory_bytes"),
    ({"url": "http://h:1", "shared_memory_bytes": -1}, "shared_memory_bytes"),
    ({"cpu_bytes": "lots"}, "cpu_bytes"),
    ({"cpu_bytes": 0, "disk_bytes": 0}, "cpu_bytes"),
    ({"url": "h:1"}, "url"),
    ({"url": "http://h:1", "timeout_s": 0}, "timeout_s"),
    ({"url": "http://h:1", "tokens": {"salt": 3}}, "tokens"),
    ({"url": "http://h:1", "load_async": "yes"}, "load_async"),
    ({"url": "http://h:1", "page_size": 0}, "page_size"),
    ({"policy": "fifo"}, "policy"),
])
def test_bad_settings_name_the_key(extra, named):
    with pytest.raises(ValueError, match=named):
        ConnectorConfig.from_extra_config(extra)


def test_model_name_is_the_checkpoint_directorys_own_name(tmp_path):
    (tmp_path / "tiny-llama").mkdir()
    assert store_model_name(str(tmp_path / "tiny-llama")) == "tiny-llama"
    assert store_model_name([str(tmp_path / "tiny-llama") + "/"]) == "tiny-llama"
    assert store_model_name("meta-llama/Llama-3.1-8B") == "meta-llama/Llama-3.1-8B"
    assert store_model_name("anything", "mine") == "mine"


@pytest.mark.parametrize("name", ["gqa", "gqa4-llama3", "linear-tied"])
def test_spec_equals_the_decode_loops_for_the_same_checkpoint(checkpoints, name):
    transformers = pytest.importorskip("transformers")
    from kvstore.decode.loader import load_checkpoint

    decode_model = load_checkpoint(checkpoints[name])
    hf = transformers.AutoConfig.from_pretrained(checkpoints[name])
    spec = model_spec(num_layers=hf.num_hidden_layers, num_kv_heads=hf.num_key_value_heads,
                      head_dim=getattr(hf, "head_dim", None) or hf.hidden_size // hf.num_attention_heads,
                      kv_dtype=decode_model.dtype, page_size=16, hf_config=hf)
    assert spec == decode_model.spec


def test_a_kv_dtype_the_store_cannot_hold_is_refused():
    with pytest.raises(ValueError, match="float8"):
        model_spec(num_layers=1, num_kv_heads=1, head_dim=8, kv_dtype="torch.float8_e4m3fn", page_size=16,
                   hf_config=types.SimpleNamespace(rope_theta=10000.0))
