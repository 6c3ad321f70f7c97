"""The profiling tool (python -m bench.profiling): the floor store is a store (the bytes come
back, bad input is refused, the oldest unpinned page makes room), the floor and the breakdown
print and write every figure, the breakdown's categories add up, and an unknown subcommand is
refused by name. No assertion is on speed."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from bench.profiling import __main__ as profiling
from bench.profiling import breakdown
from bench.profiling.floor import FloorStore

SHAPE = (1, 2, 4, 2, 8)


def kv(seed: int) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal(SHAPE).astype(np.float16))


def test_the_floor_store_returns_what_it_stored_and_evicts_the_oldest_unpinned_page() -> None:
    store = FloorStore(4, SHAPE, capacity=2)
    a, b, c = [1, 2, 3, 4], [5, 6, 7, 8], [9, 10, 11, 12]
    assert store.store(a, kv(1)) == 4 and store.store(b, kv(2)) == 4
    assert store.store(a, kv(1)) == 0  # held already: touched, not written again
    got = store.fetch(b)
    assert got.matched_tokens == 4 and torch.equal(got.kv, kv(2))
    assert store.store(c, kv(3)) == 4  # full: the least recently used (a) goes
    assert store.fetch(a).matched_tokens == 0 and store.fetch(a).kv is None
    assert torch.equal(store.fetch(c).kv, kv(3)) and torch.equal(store.fetch(b).kv, kv(2))


@pytest.mark.parametrize("tokens", [[1, 2, 3], [1, 2, 3, -1], [1, 2, 3, 1 << 31], [1, 2, 3, True], (1, 2, 3, 4),
                                    [1, 2, 3, 4.0]])
def test_the_floor_store_refuses_bad_tokens(tokens) -> None:
    store = FloorStore(4, SHAPE, capacity=2)
    with pytest.raises(ValueError, match="tokens"):
        store.fetch(tokens)


@pytest.mark.parametrize("bad", [kv(1).float(), kv(1)[:, :, :2], kv(1).transpose(3, 4), kv(1).numpy()])
def test_the_floor_store_refuses_bad_kv(bad) -> None:
    store = FloorStore(4, SHAPE, capacity=2)
    with pytest.raises(ValueError, match="kv"):
        store.store([1, 2, 3, 4], bad)
    assert store.fetch([1, 2, 3, 4]).matched_tokens == 0  # nothing half-stored


def test_the_script_prints_both_cases_and_every_step(tmp_path, capsys) -> None:
    out = tmp_path / "floor.json"
    assert profiling.main(["floor", "--rounds", "1", "--seconds", "0.01", "--step-scale", "0.001",
                           "--json", str(out)]) == 0
    printed = capsys.readouterr().out
    result = json.loads(out.read_text())
    assert [c["op"] for c in result["cases"]] == ["fetch", "store"]
    for c in result["cases"]:
        assert c["kvstore_vs_dict"] == pytest.approx(c["kvstore_us"] / c["dict_us"])
        assert c["floor_vs_dict"] == pytest.approx(c["floor_us"] / c["dict_us"])
        assert f"| {c['op']} | 64 KiB |" in printed
    assert len(result["floor_fetch_steps"]) == 8 and all(s["us"] > 0 for s in result["floor_fetch_steps"])
    assert "| sum |" in printed


def test_categories_group_a_profile() -> None:
    """Python code by its file, builtins by their name, and a builtin without a category of its
    own in its caller's, split by what each caller spent in it."""
    store = ("/x/kvstore/store.py", 10, "fetch")
    index = ("/x/kvstore/index.py", 5, "match")
    copy = ("~", 0, "<built-in method numpy.copyto>")
    getter = ("~", 0, "<method 'get' of 'dict' objects>")
    stats = {
        store: (1, 1, 0.010, 0.050, {}),
        index: (1, 1, 0.004, 0.010, {store: (1, 1, 0.004, 0.010)}),
        copy: (1, 1, 0.020, 0.020, {store: (1, 1, 0.020, 0.020)}),
        getter: (2, 2, 0.006, 0.006, {store: (1, 1, 0.002, 0.002), index: (1, 1, 0.004, 0.004)}),
    }
    got = breakdown.categorize(stats)
    assert got == pytest.approx({"store control flow": 0.012, "token hashing and tree match": 0.008, "copy": 0.020})


def test_profile_in_process_cases(tmp_path) -> None:
    out = tmp_path / "profile.json"
    assert breakdown.main(["--quick", "--paths", "in-process", "--json", str(out)]) == 0
    cases = json.loads(out.read_text())["this run"]["cases"]
    assert sorted(cases) == ["in-process fetch 2 MiB", "in-process fetch 64 KiB", "in-process store 2 MiB",
                             "in-process store 64 KiB"]
    for case in cases.values():
        # Shares of the profile scaled to the unprofiled p50: they add up to it.
        assert sum(case["categories_us"].values()) == pytest.approx(case["p50_us"])
        assert "harness" not in case["categories_us"]
    # A 2 MiB fetch copies its bytes: the copy is seen (numpy's copyto is wrapped while profiling).
    assert cases["in-process fetch 2 MiB"]["categories_us"]["copy"] > 0


def test_an_unknown_subcommand_is_refused_by_name(capsys) -> None:
    assert profiling.main(["flor"]) == 2
    assert "unknown subcommand 'flor'" in capsys.readouterr().err
