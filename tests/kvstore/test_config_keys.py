"""Config validation and key determinism, as a user meets them."""
import subprocess
import sys

import pytest

from kvstore import ModelSpec, StoreConfig
from kvstore.keys import chunk_key, namespace_key, prefix_keys
from kvstore.sizes import format_bytes, parse_bytes


def test_spec_derived_sizes():
    spec = ModelSpec(num_layers=32, num_kv_heads=8, head_dim=128, dtype="bfloat16", page_size=16)
    assert spec.page_shape == (32, 2, 16, 8, 128)
    assert spec.bytes_per_token == 32 * 2 * 8 * 128 * 2
    assert spec.page_bytes == spec.bytes_per_token * 16


@pytest.mark.parametrize("field,value", [
    ("num_layers", 0), ("num_kv_heads", -1), ("head_dim", 1.5), ("dtype", "int8"),
    ("page_size", 0), ("rope_style", "other"), ("rope_theta", 0.0),
])
def test_bad_spec_names_field(field, value):
    kwargs = dict(num_layers=2, num_kv_heads=2, head_dim=8)
    kwargs[field] = value
    with pytest.raises(ValueError, match=field):
        ModelSpec(**kwargs)


def test_spec_dtypes_are_the_kv_dtypes_of_the_store_and_kernels():
    # config.py names the dtypes without torch; the torch table (kvstore.gpu.dtypes) must agree.
    from kvstore.config import DTYPE_BYTES
    from kvstore.gpu.dtypes import KV_DTYPES

    assert {name: dtype.itemsize for name, dtype in KV_DTYPES.items()} == DTYPE_BYTES


def test_rope_scaling_is_frozen_and_round_trips():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    spec = ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, rope_scaling=scaling)
    assert spec.rope_scaling_dict == scaling
    assert ModelSpec.from_dict(spec.to_dict()) == spec
    hash(spec)
    with pytest.raises(ValueError, match="rope_scaling"):
        ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, rope_scaling={"rope_type": "bogus"})


@pytest.mark.parametrize("field,value", [
    ("cpu_bytes", -1), ("cpu_codec", "gzip"), ("policy", "fifo"), ("durability", "sometimes"),
    ("disk_compression", "lz4"), ("zstd_level", 99),
])
def test_bad_store_config_names_field(field, value):
    with pytest.raises(ValueError, match=field):
        StoreConfig(**{field: value})


def test_policies_are_duel_its_two_rules_and_lru_and_the_research_ones_are_refused():
    for name in ("lru", "lru-tail", "seen-before", "duel"):
        assert StoreConfig(policy=name).policy == name
    assert StoreConfig().policy == "duel"
    # Studied on the way to duel, they live in bench/ (bench/research/policies.py).
    for name in ("lru-prefix", "arc-prefix", "arc-tail", "seen-often", "seen-learned", "duel-freq"):
        refused = f"^policy: must be one of lru, lru-tail, seen-before, duel; got '{name}'$"
        with pytest.raises(ValueError, match=refused):
            StoreConfig(policy=name)


def test_config_needs_a_tier_and_disk_for_write_through():
    with pytest.raises(ValueError, match="at least one tier"):
        StoreConfig(cpu_bytes=0, disk_bytes=0)
    with pytest.raises(ValueError, match="write-through"):
        StoreConfig(disk_bytes=0, durability="write-through")


def test_parse_bytes():
    assert parse_bytes("8GiB") == 8 << 30
    assert parse_bytes("512 MiB") == 512 << 20
    assert parse_bytes("1.5k") == 1500
    assert parse_bytes(42) == 42
    with pytest.raises(ValueError, match="cpu_bytes"):
        parse_bytes("lots", field="cpu_bytes")
    assert format_bytes(8 << 30) == "8.0GiB"


def test_keys_are_deterministic_across_processes():
    code = ("from kvstore.keys import namespace_key, prefix_keys;"
            "ns = namespace_key('m', 'fp', 't'); print(prefix_keys(ns, list(range(10)), 4)[-1].hex())")
    outs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
            for _ in range(2)}
    ns = namespace_key("m", "fp", "t")
    assert outs == {prefix_keys(ns, list(range(10)), 4)[-1].hex() + "\n"}


def test_keys_chain_and_separate_namespaces():
    a = namespace_key("m", "fp", None)
    b = namespace_key("m", "fp", "tenant")
    assert a != b and namespace_key("ab", "c") != namespace_key("a", "bc")
    keys = prefix_keys(a, [1, 2, 3, 4, 5, 6], 4)
    assert len(keys) == 2  # one full page, one tail page
    assert prefix_keys(a, [1, 2, 3, 4, 9], 4)[0] == keys[0]
    assert prefix_keys(a, [9, 2, 3, 4, 5, 6], 4)[1] != keys[1]  # chained: a different first page changes the rest
    assert chunk_key(a, [1, 2]) != chunk_key(b, [1, 2])
