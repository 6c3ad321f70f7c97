"""Shared fixtures: a tiny model spec and stores on temporary data dirs."""
from __future__ import annotations

import pytest
import torch

from kvstore import KVStore, ModelSpec, StoreConfig


def pytest_collection_modifyitems(config, items):
    cuda = torch.cuda.is_available()
    try:
        import cupy  # noqa: F401
        has_cupy = True
    except Exception:
        has_cupy = False
    skip = pytest.mark.skip(reason="needs CUDA and CuPy: none on this machine")
    # The full-size variants (marked slow: the reliability scenarios at full size, the research
    # policies' long replays) run only when asked for, so that `make test` stays within its time;
    # bench/chaos.py and bench/eviction.py run the same code at full size.
    run_slow = "slow" in (config.getoption("markexpr") or "")
    skip_slow = pytest.mark.skip(reason="full-size run: pytest -m slow tests/reliability tests/bench")
    for item in items:
        if item.get_closest_marker("gpu") is not None and not (cuda and has_cupy):
            item.add_marker(skip)
        if item.get_closest_marker("slow") is not None and not run_slow:
            item.add_marker(skip_slow)


@pytest.fixture
def spec() -> ModelSpec:
    return ModelSpec(num_layers=2, num_kv_heads=2, head_dim=8, dtype="float16", page_size=4)


@pytest.fixture
def make_store(tmp_path):
    stores: list[KVStore] = []

    def make(**overrides) -> KVStore:
        fields = {"data_dir": str(tmp_path / "data"), "cpu_bytes": 1 << 20, "disk_bytes": 8 << 20}
        fields.update(overrides)
        store = KVStore(StoreConfig(**fields))
        stores.append(store)
        return store

    yield make
    for store in stores:
        store.close()
