"""Run every reliability scenario at full size and print the README's Reliability table.

    python bench/chaos.py [--json FILE] [--load-s 60] [--only crash|corruption|concurrency|load|audit]
                          [--audit-hits 200] [--audit-vllm-hits 100] [--audit-dtypes float32,bfloat16]

Scenarios live in bench/reliability/ (tests/reliability/ runs the same code small).
"""
from __future__ import annotations

import dataclasses
import sys
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

sys.path.append(str(Path(__file__).resolve().parents[1]))  # after PYTHONPATH: an older kvstore there wins

from bench.reliability.concurrency import ConcurrencyReport, run_in_process, run_restarts, run_sidecar  # noqa: E402
from bench.reliability.corruption import run_flips, run_page_damage, run_payloads  # noqa: E402
from bench.reliability.crash import run_crash  # noqa: E402
from bench.reliability.full_disk import run_full_disk  # noqa: E402
from bench.reliability.load import run_load  # noqa: E402
from bench.report import markdown_table, parser as bench_parser, write_json  # noqa: E402

if TYPE_CHECKING:  # the audit's modules load torch and the model: only when it runs
    from bench.reliability.audit import FaultCase

CRASH_ROUNDS = 25
PAGE_TRIALS = 500  # reopenings after leaf/branch page damage
CONCURRENCY_OPS = 1_000_000  # in-process and again through the sidecar; a twentieth more against restarts


def main(argv: list[str] | None = None) -> int:
    parser = bench_parser(__doc__)
    parser.add_argument("--load-s", type=float, default=60.0)
    parser.add_argument("--audit-hits", type=int, default=200,
                        help="clean audited hits of the decode loop per dtype (float32, bfloat16) and path "
                             "(in-process, sidecar)")
    parser.add_argument("--audit-vllm-hits", type=int, default=100,
                        help="clean audited hits of each vLLM engine (float32 and bfloat16, in-process and sidecar)")
    parser.add_argument("--audit-dtypes", default="float32,bfloat16",
                        help="the audit's dtypes, comma-separated (bfloat16 is slow on CPUs without AVX512-BF16)")
    parser.add_argument("--only", choices=["crash", "corruption", "concurrency", "load", "audit"],
                        help="run only this scenario")
    args = parser.parse_args(argv)
    rows: list[tuple[str, str]] = []
    reports: dict[str, object] = {}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        if args.only == "audit":
            _audit(args.audit_hits, args.audit_vllm_hits, args.audit_dtypes.split(","), rows, reports)
        if args.only in (None, "concurrency"):
            _concurrency(work, CONCURRENCY_OPS, rows, reports)
        if args.only in (None, "crash"):
            _crash(work, rows, reports)
        if args.only in (None, "corruption"):
            _corruption(work, rows, reports)
        if args.only in (None, "load"):
            _full_disk_and_load(work, args.load_s, rows, reports)
    _print(rows, reports, args.json)
    return 0


def _crash(work: Path, rows: list[tuple[str, str]], reports: dict[str, object]) -> None:
    """SIGKILLs under store load, in both durability modes."""
    for mode, rounds in (("write-through", CRASH_ROUNDS), ("write-back", CRASH_ROUNDS // 2)):
        began = time.perf_counter()
        r = run_crash(work / f"crash-{mode}", rounds=rounds, durability=mode, seed=7)
        reports[f"crash_{mode}"] = r
        rows.append((f"SIGKILL under store load, {mode}",
                     f"{r.rounds} kills, {r.acked_stores} acked stores, {r.checked_sequences} fetches checked: "
                     f"{r.lost_acked} acked lost{' (allowed: write-back)' if mode == 'write-back' else ''}, "
                     f"{r.wrong_kv} wrong KV, {r.over_served} over-served, "
                     f"{r.repairs} LMDB repairs; restart {max(r.restart_s):.1f} s max "
                     f"({time.perf_counter() - began:.0f} s)"))


def _corruption(work: Path, rows: list[tuple[str, str]], reports: dict[str, object]) -> None:
    """Damage to LMDB while the store is stopped: its pages, random bytes, records."""
    began = time.perf_counter()
    r = run_page_damage(work, trials=PAGE_TRIALS, seed=16)
    reports["page_damage"] = r
    rows.append(("1-4 bytes of LMDB leaf/branch pages overwritten while stopped, each reopen in a child",
                 f"{r.trials} trials, {r.damaged} bytes in {r.pages_damaged} pages: {r.killed} processes killed, "
                 f"{len(r.failed)} errors raised, {r.wrong_kv} wrong KV in {r.fetches} fetches, "
                 f"{r.served_tokens / r.stored_tokens:.0%} of tokens still served, "
                 f"{r.quarantined} environments moved aside, "
                 f"{r.corrupt_counted} corrupt records counted; "
                 f"{r.stored_after} new stores after, {r.stored_after_wrong} wrong "
                 f"({time.perf_counter() - began:.0f} s)"))
    r = run_flips(work, trials=30, flips=(1, 8, 64, 512))
    reports["flips"] = r
    rows.append(("random bytes of data.mdb overwritten while stopped, each reopen in a child",
                 f"{r.trials} trials, {r.damaged} bytes: {r.killed} processes killed, "
                 f"{len(r.failed)} errors raised, "
                 f"{r.wrong_kv} wrong KV in {r.fetches} fetches, "
                 f"{r.served_tokens / r.stored_tokens:.0%} of tokens still served, "
                 f"{r.quarantined} environments moved aside, "
                 f"{r.corrupt_counted} corrupt records counted"))
    r = run_payloads(work, records=20)
    reports["payloads"] = r
    rows.append(("record payloads/headers rewritten through LMDB",
                 f"{r.damaged} records: {r.wrong_kv} wrong KV, {r.corrupt_counted} counted on /metrics, "
                 f"{r.corrupt_left} left in LMDB"))


def _full_disk_and_load(work: Path, load_s: float, rows: list[tuple[str, str]], reports: dict[str, object]) -> None:
    for mode in ("write-back", "write-through"):
        r = run_full_disk(work, durability=mode)
        reports[f"full_disk_{mode}"] = r
        rows.append((f"full disk ({r.filesystem}, then filled by another file), {mode}",
                     f"{r.stores} stores: {r.ok} x 200, {r.insufficient_storage} x 507, "
                     f"{len(r.other_errors)} other; "
                     f"{r.disk_evictions} disk evictions, {r.wrong_kv} wrong KV, alive {r.alive}, "
                     f"newest pages served from CPU {r.newest_from_cpu}"))
    r = run_load(work, clients=32, duration_s=load_s)
    reports["load"] = r
    rows.append((f"load: 32 clients, {r.duration_s:.0f} s, 64 KiB-2 MiB pages",
                 f"{r.requests} requests, {r.requests_per_s:.0f} req/s, p50 {r.percentile_ms(0.5):.0f} ms, "
                 f"p99 {r.percentile_ms(0.99):.0f} ms; {r.server_errors} 5xx, {r.wrong_bytes} wrong bytes; "
                 f"RSS anon peak {r.peak_rss_anon_bytes >> 20} MiB "
                 f"(idle {r.baseline_rss_bytes >> 20} MiB, CPU tier 512 MiB)"))
    rows.append(("slow clients (a byte a second) and connection limit",
                 f"{r.slow_cut_off}/{r.slow_clients} cut off with 408 "
                 f"(slowest {r.slow_cut_s:.1f} s, body timeout 2 s); "
                 f"{r.connections_refused} of {r.connections_tried} connections refused 503 "
                 "at --max-connections 64"))


def _concurrency(work: Path, ops: int, rows: list[tuple[str, str]], reports: dict[str, object]) -> None:
    runs = [("in-process", "nothing evicted", run_in_process, ops * 3 // 5),
            ("in-process", "constant eviction", run_in_process, ops - ops * 3 // 5),
            ("sidecar", "nothing evicted", run_sidecar, ops * 3 // 5),
            ("sidecar", "constant eviction", run_sidecar, ops - ops * 3 // 5)]
    for i, (path, capacity, run, n) in enumerate(runs):
        r = run(work / f"concurrency-{i}", ops=n, capacity=capacity, seed=10 + i)
        reports[f"concurrency_{path}_{capacity.replace(' ', '_')}"] = r
        rows.append((f"concurrency, {r.path}, {capacity}: 8 {'threads' if path == 'in-process' else 'clients'}",
                     _concurrency_result(r)))
    r = run_restarts(work / "concurrency-restarts", ops=max(2_000, ops // 20), kills=max(1, ops // 200_000), seed=20)
    reports["concurrency_restarts"] = r
    rows.append((f"concurrency, {r.path}: 8 clients, {r.kills} kills", _concurrency_result(r)))


def _audit(hits: int, vllm_hits: int, dtypes: list[str], rows: list[tuple[str, str]],
           reports: dict[str, object]) -> None:
    """Audited reuse on the real model (bench/reliability/audit.py, vllm_audit.py): every fault,
    then the clean hits behind the tolerance, in the decode loop (prefixes and CacheBlend chunks)
    and in vLLM."""
    from bench.reliability.audit import real_model, run_chunk_clean, run_chunk_faults, run_clean, run_faults
    from bench.reliability.vllm_audit import run_vllm_audit

    for dtype in dtypes:
        model = real_model(dtype)
        for kind, run in (("prefix", run_faults), ("chunk", run_chunk_faults)):
            for case in run(dtype, model=model):
                reports[f"audit_{kind}_fault_{dtype}_{case.fault}_{case.where.replace(' ', '_')}"] = case
                rows.append((f"audit, decode loop, {dtype}, {kind}: {case.fault} in the {case.where}",
                             _fault_row(case)))
        for path in ("in-process", "sidecar", "chunks"):
            r = run_chunk_clean(dtype, hits, model=model) if path == "chunks" else \
                run_clean(dtype, hits, path=path, model=model)
            reports[f"audit_clean_{dtype}_{path}"] = r
            rows.append((f"audit, decode loop, {dtype}, {path}: clean audits of real text",
                         f"{r.hits} audits: **{r.failures} false alarms**; worst deviation {max(r.worst):.3g} "
                         f"({r.worst_in_eps:.1f} eps) against a tolerance of {r.tolerance:.3g} ({r.seconds:.0f} s)"))
    for dtype in dtypes:
        for path in ("in-process", "sidecar"):
            v = run_vllm_audit(dtype, path, vllm_hits)
            reports[f"audit_vllm_{dtype}_{path}"] = v
            caught = ", ".join(f"{c.fault} {'caught' if c.detected else 'SLIPPED'}"
                               f"{'' if c.ok else ' (not all checks held)'}" for c in v.faults)
            rows.append((f"audit, vLLM {dtype}, {path}",
                         f"{v.cross_engine_hits} clean hits on the decode loop's pages + {v.same_engine_hits} on "
                         f"vLLM's own: **{v.failures} false alarms**; faults: {caught} ({v.seconds:.0f} s)"))


def _fault_row(case: FaultCase) -> str:
    verdict = (f"**caught** on the first audited hit (layer {case.first_layer}, deviation {case.worst:.3g} > "
               f"{case.tolerance:.3g})" if case.detected else
               f"**slipped** (deviation {case.worst:.3g} <= {case.tolerance:.3g})")
    return (f"{verdict}; store still matched {case.left_tokens} tokens; audited request = its full prefill: "
            f"{case.audited_answer_ok}; next request recomputed {case.next_recomputed}, = its full prefill: "
            f"{case.next_answer_ok}; a later hit passed: {case.later_passed} ({case.seconds:.0f} s)")


def _concurrency_result(r: ConcurrencyReport) -> str:
    kinds = ", ".join(f"{n:,} {kind}" for kind, n in r.by_kind.items())
    rules = f"{r.wrong_kv} wrong KV, {r.over_matched} over-matched"
    if r.capacity == "nothing evicted":
        rules += f", {r.under_matched} under-matched (read-your-writes)"
    counters = "" if r.kills else f", {len(r.counter_mismatches)} counter mismatches"
    return (f"{r.ops:,} operations ({kinds}), {r.checked:,} answered and checked, {r.evictions:,} evictions: "
            f"{rules}{counters}, {len(r.unexpected_errors)} unexpected errors ({r.duration_s:.0f} s)")


def _print(rows: list[tuple[str, str]], reports: dict[str, object], json_path: str | None) -> None:
    print(markdown_table(["scenario", "result", "command"], ([*row, "`python bench/chaos.py`"] for row in rows)))
    write_json(json_path, {k: {f: v for f, v in dataclasses.asdict(r).items() if f != "latencies_s"}  # type: ignore[call-overload]
                           for k, r in reports.items()})


if __name__ == "__main__":
    sys.exit(main())
