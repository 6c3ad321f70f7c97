"""Shared fixtures: a tiny model spec and stores on temporary data dirs."""
from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from kvstore import KVStore, ModelSpec, StoreConfig


def pytest_configure(config):
    """Under `pytest -n N` (make test), each worker gets its own share of the CPUs, and whole files
    are handed out in the order `heavy_files_first` gives them.

    Without the affinity every worker's torch, and every vLLM engine or sidecar a test starts, sizes its
    thread pool to the whole machine, and N workers' spinning OpenMP threads fight over the same
    cores, which costs far more than the parallelism gains. The affinity is inherited by the
    processes a test starts (vLLM binds its threads to the CPUs it is allowed)."""
    if config.getoption("dist", "no") == "loadfile":
        # xdist would hand out files by their number of tests, most first, which leaves the
        # files of one to three long tests for last: keep the order heavy_files_first gives.
        config.option.loadscopereorder = False
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
    # policies' long replays, the TP=4 engine) run only when asked for, so that `make test` stays
    # within its time; bench/chaos.py, bench/eviction.py and bench/vllm_tp.py run the same code
    # at full size.
    run_slow = "slow" in (config.getoption("markexpr") or "")
    for item in items:
        if item.get_closest_marker("gpu") is not None and not (cuda and has_cupy):
            item.add_marker(skip)
        if item.get_closest_marker("slow") is not None and not run_slow:
            item.add_marker(pytest.mark.skip(reason=f"full-size run: pytest -m slow {item.nodeid.split('::')[0]}"))
    items[:] = heavy_files_first(items)


def heavy_files_first(items: list[pytest.Item]) -> list[pytest.Item]:
    """The files marked `heavy` (`pytestmark`: a real model, vLLM engines, many processes) first, in
    collection order, then the rest by their number of tests, fewest first; tests keep their
    order within a file.

    xdist gives each worker a whole file at a time in this order (pytest_configure keeps it), so
    the longest files start at once. A file of few tests is mostly end-to-end scenarios (a sidecar,
    a subprocess, seconds each); a file of many is mostly unit tests of milliseconds: those last
    make a tail of short files that the workers share out evenly, and they finish together."""
    files: dict[str, list[pytest.Item]] = {}
    for item in items:
        files.setdefault(item.nodeid.split("::", 1)[0], []).append(item)

    def rank(tests: list[pytest.Item]) -> tuple[int, int]:
        return (0, 0) if tests[0].get_closest_marker("heavy") is not None else (1, len(tests))

    order = sorted(files.values(), key=rank)  # stable: heavy files keep their collection order
    return [item for tests in order for item in tests]


@pytest.fixture(scope="session")
def smollm2() -> Path:
    """The real model's checkpoint directory (make install pulls it; a cached one is returned at once)."""
    from kvstore.decode.model_pull import pull

    return pull("smollm2")


@pytest.fixture(scope="session")
def smollm2_model(smollm2: Path):
    """The real model, loaded once per process for every file that runs it (tests only read its
    weights and tokenizer; each builds its own caches and stores)."""
    from kvstore.decode import load_checkpoint

    return load_checkpoint(smollm2, name="smollm2")


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
