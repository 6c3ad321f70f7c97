"""Shared fixtures: a tiny model spec and stores on temporary data dirs."""
from __future__ import annotations

import os

import pytest
import torch

from kvstore import KVStore, ModelSpec, StoreConfig


def pytest_configure(config):
    """Under `pytest -n N` (make test), each worker gets its own share of the CPUs.

    Without it every worker's torch, and every vLLM engine or sidecar a test starts, sizes its
    thread pool to the whole machine, and N workers' spinning OpenMP threads fight over the same
    cores, which costs far more than the parallelism gains. The affinity is inherited by the
    processes a test starts (vLLM binds its threads to the CPUs it is allowed)."""
    worker, count = os.environ.get("PYTEST_XDIST_WORKER"), os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if worker is None or count is None or not hasattr(os, "sched_setaffinity"):
        return
    cpus = sorted(os.sched_getaffinity(0))
    # A worker that replaces a crashed one gets the next name (gw2 of 2): it takes the share of
    # the slot it fills.
    count = int(count)
    index = int(worker.removeprefix("gw")) % count
    share = cpus[index * len(cpus) // count:(index + 1) * len(cpus) // count]
    if not share:  # more workers than CPUs: leave the scheduler to share them
        return
    os.sched_setaffinity(0, share)
    torch.set_num_threads(len(share))  # torch sized its pool when it was imported, before this
    os.environ["OMP_NUM_THREADS"] = str(len(share))


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
