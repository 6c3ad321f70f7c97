"""bench/vllm_ttft.py judges each target on the figures it covers, and one figure over its limit
fails the target."""
from __future__ import annotations

from bench import vllm_ttft


def row(size: int, case: str, ttft_s: float, vs_own_hit: float | None = None, vs_full: float = 0.01,
        connector_s: dict[str, float] | None = None) -> dict:
    return dict(size=size, case=case, ttft_s=ttft_s, vs_own_hit=vs_own_hit, vs_full=vs_full, connector_s=connector_s)


def table(own_hit_2k_shm: float, miss_store_s: float) -> list[dict]:
    rows = []
    for size in (1024, 2048):
        rows += [row(size, "full prefill (no connector)", 1.0, vs_full=1.0),
                 row(size, "in-process store, nothing to hit", 1.0, connector_s={"gather_s": 0.01, "store_s": 0.01}),
                 row(size, "sidecar, nothing to hit", 1.0, connector_s={"gather_s": 0.01, "store_s": miss_store_s}),
                 row(size, "kvstore hit: in-process CPU tier", 0.1, vs_own_hit=1.1,
                     vs_full=0.5 if size < 2048 else 0.1),
                 row(size, "kvstore hit: sidecar, shared memory", 0.1,
                     vs_own_hit=own_hit_2k_shm if size == 2048 else 1.1),
                 row(size, "kvstore hit: sidecar, TCP", 0.2, vs_own_hit=1.9)]
    # The audited engine (--audit-rate) runs at 2k: its hit against the unaudited one.
    rows.append(dict(row(2048, "kvstore hit: in-process, audited", 0.11), vs_unaudited_hit=1.1))
    return rows


def test_targets_met_and_missed() -> None:
    results = {"inproc": {"connector_share_of_decode_step": 0.005, "connector_share_of_prefill": 0.02}}
    met = {c["target"]: c for c in vllm_ttft.judge_targets(table(1.15, 0.005), results)}
    assert set(met) == set(vllm_ttft.TARGETS)
    assert all(c["met"] for c in met.values())
    assert met["hit_vs_own_hit"]["values"] == [1.1, 1.1, 1.1, 1.15]
    assert met["hit_vs_full_from_2k"]["values"] == [0.1, 0.01]  # the 1k hit's 0.5 is not judged
    assert met["tcp_hit_vs_own_hit_2k"]["values"] == [1.9]
    assert met["miss_work_share_of_prefill"]["values"][-1] == 0.02  # every hook of a 512-token prefill
    assert met["audited_hit_vs_hit_2k"]["values"] == [1.1]
    # Without an audited engine (no --audit-rate) that target has no figure and is not judged.
    unaudited = [r for r in table(1.15, 0.005) if r["case"] != "kvstore hit: in-process, audited"]
    assert {c["target"] for c in vllm_ttft.judge_targets(unaudited, results)} == set(vllm_ttft.TARGETS) - {
        "audited_hit_vs_hit_2k"}
    missed = {c["target"]: c["met"] for c in vllm_ttft.judge_targets(table(1.25, 0.05), results)}
    assert missed["hit_vs_own_hit"] is False and missed["miss_work_share_of_prefill"] is False
    assert missed["tcp_hit_vs_own_hit_2k"] is True
    results["inproc"]["connector_share_of_prefill"] = 0.04
    hooks = {c["target"]: c["met"] for c in vllm_ttft.judge_targets(table(1.15, 0.005), results)}
    assert hooks["miss_work_share_of_prefill"] is False
    # A decode too short to time against the prefill's noise has no hooks figure: not judged, not met.
    results["inproc"]["connector_share_of_decode_step"] = None
    assert "hooks_share_of_decode_step" not in {c["target"] for c in vllm_ttft.judge_targets(table(1.15, 0.005),
                                                                                           results)}
